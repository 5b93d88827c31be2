"""A bound on the bytes of one request body: larger ones get a 413 before any of it is parsed or kept."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.server.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 4 << 20      # 4 MiB: about a million tokens of text, far past any context here
DRAIN_BYTES = 64 << 20                   # a refused body up to this size is read and dropped before the 413


class LimitRequestBytes:
    """ASGI middleware: reads an HTTP body up to max_bytes (a Content-Length above it is refused unparsed),
    then hands the app the whole body as one message; later receive() calls reach the client, so a
    handler still sees its disconnect."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await self.refuse(scope, receive, send, APIError(400, "the Content-Length header is not a number"))
            if int(declared) > self.max_bytes:
                return await self.refuse(scope, receive, send, self.too_large())
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":          # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self.refuse(scope, receive, send, self.too_large())
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                             f"(--max-request-bytes)")

    @staticmethod
    async def refuse(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        """The error, after reading (not keeping) up to DRAIN_BYTES of the body still coming: closing a socket
        with unread data resets it, and a client still sending then loses the response. Connection: close,
        since a longer body is left unread."""
        drained = 0
        while drained < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                break
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await error.response({"Connection": "close"})(scope, receive, send)
