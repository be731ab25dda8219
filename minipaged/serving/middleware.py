"""Security and limits, before any route: the loopback checks and ``GuardMiddleware``."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from minipaged.serving.protocol import error_body

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_READ_TIMEOUT = 30.0


def host_is_loopback(host_header: str) -> bool:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":")[0]
    return host in LOOPBACK_HOSTS


def origin_is_loopback(origin: str) -> bool:
    if origin == "null":
        return False
    rest = origin.split("://", 1)[-1]
    return host_is_loopback(rest.split("/")[0])


class GuardMiddleware:
    """Refuses, before any route: a ``Host`` or ``Origin`` that is not loopback (DNS rebinding,
    cross-site pages), a missing or wrong API key on ``/v1`` routes (vLLM's rule), a body over
    ``max_body_bytes`` (413) or not received within ``read_timeout`` seconds (408)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, read_timeout: float) -> None:
        self.app, self.api_key, self.max_body_bytes, self.read_timeout = app, api_key, max_body_bytes, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            await self.discard_body(receive)
            return await self.refuse(send, *refusal)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self.refuse(send, 413, f"the body exceeds {self.max_body_bytes} bytes", None)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size, deadline = [], 0, time.monotonic() + self.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                return await self.refuse(send, 408, f"the body did not arrive within {self.read_timeout:g} s", None)
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self.refuse(send, 413, f"the body exceeds {self.max_body_bytes} bytes", None)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def refusal(self, scope, headers: dict[str, str]) -> tuple[int, str, str] | None:
        """(status, message, param) for a request refused by its headers, else None."""
        if not host_is_loopback(headers.get("host", "")):
            return 400, "the Host header must name the loopback interface", "host"
        if "origin" in headers and not origin_is_loopback(headers["origin"]):
            return 403, "requests from pages of other sites are refused", "origin"
        if self.api_key and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            if not secrets.compare_digest(headers.get("authorization", ""), f"Bearer {self.api_key}"):
                return 401, "Unauthorized", "authorization"
        return None

    async def discard_body(self, receive) -> None:
        """Read (and drop) what the client sends before refusing it, up to the body limit: a
        socket closed with unread data is reset, and the client would see the reset instead of
        the refusal."""
        size, deadline = 0, time.monotonic() + min(self.read_timeout, 5.0)
        while size <= self.max_body_bytes:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    @staticmethod
    async def refuse(send, status: int, message: str, param: str | None) -> None:
        body = json.dumps(error_body(message, status, param)).encode()
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"), *extra]})
        await send({"type": "http.response.body", "body": body})
