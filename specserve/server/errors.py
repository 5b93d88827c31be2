"""APIError: an HTTP error answered with OpenAI's error JSON."""
from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response


class APIError(Exception):
    """An error answered with OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        """The error as an HTTP response, its JSON ASCII-escaped: a message may quote text with no UTF-8 form."""
        headers = dict(headers or {})
        if self.status == 503:
            headers.setdefault("Retry-After", "1")
        return Response(json.dumps(self.body()), self.status, headers, media_type="application/json")


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
               503: "service_unavailable_error"}
