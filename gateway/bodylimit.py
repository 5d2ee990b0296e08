"""The request body limit: a pure ASGI middleware, so that a chunked body (no Content-Length)
is counted too, and an oversized one is refused with OpenAI's error shape before any handler
or JSON parser reads it.
"""

from __future__ import annotations

from typing import Any

from sdfarm.gateway.errors import APIError
from sdfarm.native.images import MAX_IMAGE_BYTES
from sdfarm.native.params import MAX_REF_IMAGES

MAX_BODY = (2 + MAX_REF_IMAGES) * MAX_IMAGE_BYTES * 4 // 3 + 64 * 1024
"""Room for every input image a job may carry (init, mask and the reference images, each at
its cap, base64), plus 64 KiB for the rest of the request. An images/edits form (raw bytes,
not base64) with its image and mask at their caps is well within it."""


class BodyLimit:
    """Refuse (413) a request whose body is over `limit` bytes; replay the body otherwise."""

    def __init__(self, app: Any, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"the request body is over {self.limit} bytes",
            code="request_too_large",
        ).response()
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await too_large(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS") and length is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
