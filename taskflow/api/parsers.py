"""The API's JSON parser: strict JSON, and no body larger than TASKFLOW["MAX_REQUEST_BYTES"]."""

from __future__ import annotations

import json
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from ..conf import get_settings
from .errors import RequestTooLarge


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class BoundedJSONParser(BaseParser):
    """Reads at most MAX_REQUEST_BYTES (+1, to notice more) whatever Content-Length claims.

    Not a JSONParser subclass: DRF reads the whole body for those (request.body, refused past
    Django's DATA_UPLOAD_MAX_MEMORY_SIZE with an HTML 400) before the parser sees it.
    """

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        limit = get_settings().MAX_REQUEST_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise RequestTooLarge(f"the request body is over {limit:,} bytes (TASKFLOW['MAX_REQUEST_BYTES'])")
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"malformed JSON: {exc}") from None
