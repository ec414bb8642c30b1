"""Named leases with an owner token and a TTL: in Redis when configured, else in the database.

A lease is held until it expires unless its owner renews it; only the owner can renew or release it,
so a process that stalls past its TTL cannot clobber the next holder. Used for leader election (the
id generator's node leases must survive a Redis flush, so they live in their own table: nodes.py).
"""

from __future__ import annotations

import threading
from datetime import timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from .redis import get_redis, key

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


def acquire(name: str, owner: str, ttl: float) -> bool:
    """Take or renew the lease `name` for `owner`; True when `owner` holds it afterwards."""
    client = get_redis()
    if client is not None:
        ms = max(1, int(ttl * 1000))
        if client.set(key("lock", name), owner, nx=True, px=ms):
            return True
        return bool(client.eval(_RENEW, 1, key("lock", name), owner, ms))
    return _outside_caller_transaction(_db_acquire, name, owner, ttl)


def release(name: str, owner: str) -> None:
    """Give the lease up if `owner` still holds it."""
    client = get_redis()
    if client is not None:
        client.eval(_RELEASE, 1, key("lock", name), owner)
        return
    from ..models import Lock

    _outside_caller_transaction(lambda: Lock.objects.filter(name=name, owner=owner).delete())


def holder(name: str) -> str | None:
    """The current owner of a lease, or None."""
    client = get_redis()
    if client is not None:
        value = client.get(key("lock", name))
        return value.decode() if value is not None else None
    from ..models import Lock

    row = Lock.objects.filter(name=name, expires_at__gt=timezone.now()).values_list("owner", flat=True).first()
    return row


def _db_acquire(name: str, owner: str, ttl: float) -> bool:
    from ..models import Lock

    now = timezone.now()
    expires = now + timedelta(seconds=ttl)
    # Take it over when it is ours or expired: a single guarded UPDATE, so two contenders
    # can never both succeed.
    with transaction.atomic():
        taken = (
            Lock.objects.filter(name=name)
            .filter(Q(owner=owner) | Q(expires_at__lte=now))
            .update(owner=owner, expires_at=expires)
        )
        if taken:
            return True
    try:
        with transaction.atomic():
            Lock.objects.create(name=name, owner=owner, expires_at=expires)
        return True
    except IntegrityError:
        return False


def _outside_caller_transaction(fn, *args):  # noqa: ANN001, ANN002, ANN202
    """Run `fn` on its own connection when called inside a transaction.

    A lease must not commit or roll back with the caller's data, so inside an atomic block the work
    runs in a short-lived thread, which Django gives its own connection.
    """
    if not connection.in_atomic_block:
        return fn(*args)
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run, name="taskflow-lease", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")
