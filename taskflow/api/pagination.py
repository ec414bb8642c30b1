"""Cursor pagination without COUNT: pages of 1 to 500 (default 50), newest first, bad cursors a 400.

A cursor is signed (django.core.signing, with SECRET_KEY) together with the list's ordering and
filters, so one this API did not give out, or one given out for another list, is refused rather
than read as some page. Rotating SECRET_KEY makes the cursors given out before it a 400 too.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlencode

from django.core import signing
from rest_framework import serializers
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request
from rest_framework.utils.urls import replace_query_param

from ..engine.validation import TASK_TYPE_RE

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


class Pages(CursorPagination):
    page_size = DEFAULT_PAGE_SIZE
    page_size_query_param = "page_size"
    max_page_size = MAX_PAGE_SIZE
    ordering = "-id"
    template = None
    # What a position the API gave out looks like (an id; a task type for ByTaskType).
    position = re.compile(r"[0-9]{1,19}")

    def get_page_size(self, request: Request) -> int:
        given = request.query_params.get(self.page_size_query_param)
        if given is None:
            return self.page_size
        if not (given.isascii() and given.isdigit() and 1 <= int(given) <= MAX_PAGE_SIZE):
            raise serializers.ValidationError({"page_size": [f"must be an integer from 1 to {MAX_PAGE_SIZE}"]})
        return int(given)

    def _salt(self, request: Request) -> str:
        """What a cursor is valid for: this list, in this order, with these filters (the page size may change)."""
        kept = sorted(
            (name, value)
            for name, values in request.query_params.lists()
            if name not in (self.cursor_query_param, self.page_size_query_param)
            for value in values
        )
        return f"taskflow.api.cursor:{type(self).__name__}:{self.ordering}:{urlencode(kept)}"

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> Any:
        self._cursor_salt = self._salt(request)  # before DRF's own, which replaces `ordering` with a tuple
        return super().paginate_queryset(queryset, request, view)

    def encode_cursor(self, cursor: Cursor) -> str:
        fields: dict[str, Any] = {}
        if cursor.offset:
            fields["o"] = cursor.offset
        if cursor.reverse:
            fields["r"] = 1
        if cursor.position is not None:
            fields["p"] = cursor.position
        token = signing.dumps(fields, salt=self._cursor_salt, compress=False)
        return replace_query_param(self.base_url, self.cursor_query_param, token)

    def decode_cursor(self, request: Request) -> Cursor | None:
        token = request.query_params.get(self.cursor_query_param)
        if token is None:
            return None
        try:
            fields = signing.loads(token, salt=self._cursor_salt)
        except (signing.BadSignature, ValueError):
            fields = None
        if not self._well_formed(fields):
            raise serializers.ValidationError({"cursor": ["not a cursor this API gave out for this list"]})
        return Cursor(offset=fields.get("o", 0), reverse=bool(fields.get("r")), position=fields.get("p"))

    def _well_formed(self, fields: Any) -> bool:
        # A signed cursor is one this API made; checked anyway, so a bug here is a 400, never a 500.
        if not isinstance(fields, dict) or set(fields) - {"o", "r", "p"}:
            return False
        offset, reverse, position = fields.get("o", 0), fields.get("r", 0), fields.get("p")
        return (
            type(offset) is int
            and 0 <= offset <= self.offset_cutoff
            and reverse in (0, 1)
            and (position is None or (isinstance(position, str) and self.position.fullmatch(position) is not None))
        )


class ByTaskType(Pages):
    ordering = "task_type"
    position = TASK_TYPE_RE
