"""Token authentication accepting both `Authorization: Token <key>` and `Authorization: Bearer <key>`."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import TokenAuthentication, get_authorization_header
from rest_framework.request import Request


class TokenOrBearerAuthentication(TokenAuthentication):
    """DRF's token authentication (rest_framework.authtoken tokens), under either keyword."""

    keywords = ("Token", "Bearer")

    def authenticate(self, request: Request) -> Any:
        auth = get_authorization_header(request).split()
        if not auth:
            return None
        for keyword in self.keywords:
            if auth[0].lower() == keyword.lower().encode():
                self.keyword = keyword
                return super().authenticate(request)
        return None

    def authenticate_header(self, request: Request) -> str:
        return 'Token realm="api", Bearer realm="api"'
