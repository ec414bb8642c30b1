"""Cursor pagination without COUNT: pages of 1 to 500 (default 50), newest first, bad cursors a 400."""

from __future__ import annotations

import re

from rest_framework import serializers
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request

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

    def decode_cursor(self, request: Request) -> Cursor | None:
        try:
            cursor = super().decode_cursor(request)
        except Exception:  # DRF's NotFound("Invalid cursor"), and anything a forged cursor provokes
            cursor = False
        if cursor is False or (
            cursor is not None and cursor.position is not None and not self.position.fullmatch(cursor.position)
        ):
            raise serializers.ValidationError({"cursor": ["not a cursor this API gave out"]})
        return cursor  # type: ignore[return-value]


class ByTaskType(Pages):
    ordering = "task_type"
    position = TASK_TYPE_RE
