"""413 for request bodies over `--max-request-body-bytes`, before they are read into memory.

A declared Content-Length over the limit is answered at once, without reading the body; a
chunked body is counted as it arrives and refused as soon as it passes the limit (the
raised `APIError` reaches the app's error handler, which answers in OpenAI's shape).
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from hetero.server.errors import APIError


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
                    code="request_too_large")


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = _too_large(self.max_bytes)
            await JSONResponse(error.body(), status_code=error.status, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)
