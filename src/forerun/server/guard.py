"""A pure ASGI guard in front of the app: the Host header (no DNS rebinding against a local server), the API key
(constant-time), and the body size while the body is read (chunked bodies included), within a deadline."""

from __future__ import annotations

import asyncio
import hmac

from forerun.server.config import ServerConfig
from forerun.server.errors import error_response
from forerun.server.metrics import Metrics

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(host: str) -> str | None:
    """The host of a Host header value, lower-cased, or None if the value is not `name[:port]` or `[v6][:port]`.

    Example:
        >>> host_name("LocalHost:8000"), host_name("[::1]:80"), host_name("[::1].evil.example")
        ('localhost', '::1', None)
        >>> host_name("127.0.0.1:80@evil.example"), host_name("[::1]evil"), host_name("")
        (None, None, None)
    """
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        name, rest = (host[1:end], host[end + 1 :]) if end > 0 else ("", "")
        if not name or any(c not in "0123456789abcdef:." for c in name):
            return None
    else:
        name, _, port = host.partition(":")
        rest = f":{port}" if _ else ""
        if not name or any(not (c.isalnum() or c in "-.") for c in name):
            return None
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return name


class Guard:
    """Pure ASGI middleware: Host check, API key, body size limit while reading; then the app, body replayed.

    Pure ASGI (not Starlette's BaseHTTPMiddleware) so the app still sees the client's disconnect.
    """

    def __init__(self, app, config: ServerConfig, metrics: Metrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        hosts = config.allowed_hosts
        if hosts is None:
            hosts = ("*",) if config.api_key else LOCAL_HOSTS
        self.any_host = "*" in hosts
        self.hosts = {h.lower().strip("[]") for h in hosts}

    async def reject(self, scope, send, status: int, message: str, kind: str = "invalid_request_error") -> None:
        """Answer before the body was read, and close the connection after the answer: a client that keeps
        sending (or trickling) a body it was refused must not hold the connection, nor reset its deadlines."""
        self.metrics.count(scope["path"], status)
        response = error_response(status, message, kind=kind, path=scope["path"])
        response.headers["connection"] = "close"
        await response(scope, self.idle_receive, send)

    @staticmethod
    async def idle_receive():
        return {"type": "http.disconnect"}

    def host_allowed(self, headers: dict[bytes, bytes]) -> bool:
        """The Host header names an allowed host: `name[:port]` or `[v6][:port]`, nothing else around it (HTTP/1.1
        requires the header; without one, only a server open to any host answers)."""
        if self.any_host:
            return True
        host = headers.get(b"host")
        name = host_name(host.decode("latin-1")) if host is not None else None
        return name is not None and name in self.hosts

    def authorised(self, headers: dict[bytes, bytes]) -> bool:
        """The key as a `Bearer` token (OpenAI's clients), or in `x-api-key` (Anthropic's SDK, Claude Code)."""
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        expected = self.config.api_key.encode()
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), expected):
            return True
        return b"x-api-key" in headers and hmac.compare_digest(headers[b"x-api-key"].strip(), expected)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        listed = scope.get("headers", [])
        headers = dict(listed)
        for name in (b"host", b"authorization", b"x-api-key"):
            if sum(1 for key, _ in listed if key == name) > 1:  # which one counts is ambiguous: neither does
                await self.reject(scope, send, 400, f"more than one {name.decode()} header")
                return
        if not self.host_allowed(headers):
            await self.reject(scope, send, 403, "Host not allowed (start the server with --allow-host NAME)")
            return
        if self.config.api_key and scope["path"] != "/health" and not self.authorised(headers):
            await self.reject(scope, send, 401, "invalid or missing API key", "authentication_error")
            return
        limit = self.config.max_body_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self.reject(scope, send, 413, f"request body over {limit} bytes")
            return
        chunks, size, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.body_timeout_s
        while more:  # read the whole body, counting as it comes (a chunked body declares no length)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                seconds = self.config.body_timeout_s
                await self.reject(scope, send, 408, f"request body not received within {seconds:g} s", "timeout")
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self.reject(scope, send, 413, f"request body over {limit} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the real channel: the app can see the client disconnect

        await self.app(scope, replay, send)
