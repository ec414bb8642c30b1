"""How the command line prints: aligned plain-text tables for people, JSON for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

EMPTY = "-"


def to_json(value: Any) -> str:
    """`value` as indented JSON; datetimes as ISO 8601, decimals and UUIDs as strings."""
    return json.dumps(value, cls=DjangoJSONEncoder, indent=2, ensure_ascii=False)


def compact_json(value: Any) -> str:
    """`value` as JSON on one line (a table cell)."""
    return json.dumps(value, cls=DjangoJSONEncoder, ensure_ascii=False, separators=(",", ":"))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows under their headers, columns padded to their widest cell; numeric columns right-aligned."""
    cells = [[cell(value) for value in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [any(r[i] != EMPTY for r in cells) and all(_is_number(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(padded).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


def fields(pairs: Sequence[tuple[str, Any]]) -> str:
    """`name  value` lines, names padded to the longest (a record, as `show` prints it)."""
    width = max((len(name) for name, _ in pairs), default=0)
    return "\n".join(f"{name.ljust(width)}  {cell(value)}" for name, value in pairs)


def cell(value: Any) -> str:
    """One value as a table shows it: "-" for nothing, local time to the second, one line."""
    if value is None or value == "":
        return EMPTY
    if isinstance(value, datetime):
        return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return " ".join(str(value).split())


def span(seconds: float) -> str:
    """A duration as `ps` and `kubectl` print it: 45s, 12m, 3h, 2d (rounded down)."""
    seconds = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def since(when: datetime | None, now: datetime) -> str:
    """How long ago `when` was ("12s ago"), or how far ahead ("in 5m")."""
    if when is None:
        return EMPTY
    seconds = (now - when).total_seconds()
    if abs(seconds) < 1:
        return "now"
    return f"{span(seconds)} ago" if seconds > 0 else f"in {span(seconds)}"


def _is_number(text: str) -> bool:
    if text == EMPTY:
        return True
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True
