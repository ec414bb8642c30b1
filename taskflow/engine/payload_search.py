"""The task list's search by a payload value: `payload.order_id = 42` in the search box.

No index can answer "tasks whose payload holds this value at this path" for any path on every
supported database, so the search is bounded instead: it reads only the newest SCAN_LIMIT tasks
matching the list's filters (the id of the SCAN_LIMIT-th newest, found by walking an index, bounds
the scan). A type filter and a created range reach further back. The same JSON path lookup runs
on SQLite, MariaDB and PostgreSQL (Django's key transforms).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models import BooleanField, Q, QuerySet
from django.db.models.expressions import RawSQL
from django.db.models.fields.json import KeyTransform

SCAN_LIMIT = 10_000
MAX_DEPTH = 8
PREFIX = "payload."
# A key: letters, digits, "_" and "-" (but no "__", Django's lookup separator); all digits: an array index.
KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,100}")
EXAMPLE = "payload.order_id = 42, payload.customer.email = \"ann@example.com\""


# How each database that compares JSON values as text names the JSON types a search value may have.
JSON_TYPES = {
    "sqlite": {"number": ("integer", "real"), "str": ("text",), "bool": ("true", "false"), "null": ("null",)},
    "mysql": {
        "number": ("INTEGER", "UNSIGNED INTEGER", "DOUBLE", "DECIMAL"),
        "str": ("STRING",),
        "bool": ("BOOLEAN",),
        "null": ("NULL",),
    },
}


class BadPayloadSearch(ValueError):
    """A search that starts as a payload search but is not one: says what is wrong and how to write it."""


@dataclass(frozen=True)
class PayloadSearch:
    path: tuple[str, ...]
    value: str | int | float | bool | None

    def apply(self, queryset: QuerySet[Any]) -> tuple[QuerySet[Any], int | None]:
        """The tasks among the newest SCAN_LIMIT of `queryset` whose payload holds the value; and the id
        that bounded the scan (None when fewer tasks matched the filters)."""
        bound = list(queryset.order_by("-pk").values_list("pk", flat=True)[SCAN_LIMIT - 1 : SCAN_LIMIT])
        if bound:
            queryset = queryset.filter(pk__gte=bound[0])
        # Key transforms built one by one, so a key named like a lookup ("contains") stays a key.
        at: Any = "payload"
        for key in self.path:
            at = KeyTransform(key, at)
        found = queryset.alias(payload_at=at).filter(payload_at=self.value)
        typed = self._json_type_condition(queryset.db)
        if typed is not None:
            found = found.filter(typed)
        return found, (bound[0] if bound else None)

    def _json_type_condition(self, alias: str) -> Any:
        """On SQLite and MariaDB/MySQL, the value's JSON type too: Django compares their values as text there,
        so 42 would match "42" (PostgreSQL compares jsonb values, types included)."""
        vendor = connections[alias].vendor
        if vendor not in JSON_TYPES:
            return None
        json_path = "$" + "".join(f"[{k}]" if k.isdigit() else f'."{k}"' for k in self.path)
        kind = "bool" if isinstance(self.value, bool) else "null" if self.value is None else type(self.value).__name__
        names = JSON_TYPES[vendor]["number" if kind in ("int", "float") else kind]
        function = "json_type(payload, %s)" if vendor == "sqlite" else "JSON_TYPE(JSON_EXTRACT(payload, %s))"
        marks = ", ".join(["%s"] * len(names))
        return Q(RawSQL(f"{function} IN ({marks})", [json_path, *names], output_field=BooleanField()))


def parse(term: str) -> PayloadSearch | None:
    """The payload search `term` asks for; None if it is not one (it does not start with "payload.")."""
    if not term.startswith(PREFIX):
        return None
    path_text, equals, raw = term[len(PREFIX) :].partition("=")
    if not equals:
        raise BadPayloadSearch(f"A payload search compares a path with a value: {EXAMPLE}.")
    keys = tuple(path_text.strip().split("."))
    bad = [k for k in keys if not KEY_RE.fullmatch(k) or "__" in k]
    if bad or not keys:
        shown = repr(bad[0]) if bad and bad[0] else "an empty key"
        raise BadPayloadSearch(
            f"Bad payload path {path_text.strip()!r}: {shown} is not a key. Keys are letters, digits, '_' "
            f"and '-' (no '__'), joined by dots: {EXAMPLE}."
        )
    if len(keys) > MAX_DEPTH:
        raise BadPayloadSearch(f"A payload path has at most {MAX_DEPTH} keys; {path_text.strip()!r} has {len(keys)}.")
    raw = raw.strip()
    if not raw:
        raise BadPayloadSearch(f"The payload search has no value after '=': {EXAMPLE}.")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw  # a bare word is a string: payload.state = done
    if isinstance(value, (dict, list)):
        raise BadPayloadSearch("A payload search compares with a number, a string, true, false or null.")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadPayloadSearch("A payload search compares with a finite number.")
    return PayloadSearch(keys, value)
