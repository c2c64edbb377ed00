"""What keeps a local server safe from the web pages its user opens (for the whole server, not only the page).

- DNS rebinding: a page on evil.example can point its own name at 127.0.0.1 and then read this server as
  "same origin". Its requests still carry `Host: evil.example`, so only the names this server is known by are
  accepted: the address it listens on, localhost, 127.0.0.1, [::1], and the --allowed-host names. A server
  bound to every interface (0.0.0.0, ::) also accepts any literal IP address: rebinding needs a name.
- Cross-site requests: any page may POST to localhost (a "simple" form post needs no CORS preflight). A
  state-changing request whose Origin is not this server itself (or an --allowed-origin) is refused.
  Requests without an Origin (curl, SDKs, other programs) are not from a browser page and pass.
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def host_name(host: str) -> str:
    """The name part of a Host header value (no port, IPv6 brackets removed), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: 421 for an unknown Host, 403 for a state-changing request from another site."""

    def __init__(self, app, bound: str = "127.0.0.1", allowed_hosts=(), allowed_origins=()):
        self.app = app
        self.names = LOCAL_NAMES | {host_name(bound)} | {host_name(h) for h in allowed_hosts}
        self.any_ip = host_name(bound) in ("0.0.0.0", "::", "")
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def host_allowed(self, host: str | None) -> bool:
        if not host:
            return False
        name = host_name(host)
        return name in self.names or (self.any_ip and _is_ip(name))

    def origin_allowed(self, origin: str | None, host: str) -> bool:
        if origin is None:
            return True
        origin = origin.rstrip("/").lower()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if not self.host_allowed(host):
            return await _refuse(send, 421, f"this server does not answer to the host name {host!r}: open it as "
                                            f"http://localhost or http://127.0.0.1 (or start it with "
                                            f"--allowed-host NAME)", "host_not_allowed")
        if scope["method"] not in SAFE_METHODS and not self.origin_allowed(headers.get("origin"), host):
            return await _refuse(send, 403, f"refused a request from the web page at {headers.get('origin')}: only "
                                            f"this server's own page may change things (or start it with "
                                            f"--allowed-origin)", "origin_not_allowed")
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
