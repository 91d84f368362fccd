"""Browsers on the daemon's own host, when no token guards the HTTP API (loopback, no token files).

A web page the user opens can make the browser POST to http://127.0.0.1:<port> (a "simple"
cross-site request needs no preflight: text/plain bodies are parsed as JSON here), or rebind its
own name to 127.0.0.1 and read the answers. Without tokens nothing else stops either, so then:
- a request carrying `Origin` (every browser POST, cross-site or not) must come from the origin it
  is sent to (scheme://Host);
- a request from a loopback peer must name a loopback host (localhost, 127.0.0.0/8, ::1): a
  rebound name does not.
Clients that are not browsers send no Origin and name the address they connect to."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

from edgespec.errors import EdgespecError


class CrossSite(EdgespecError):
    """A browser's cross-site or DNS-rebound request to an API no token guards (HTTP 403)."""


def _hostname(host: str) -> str:
    """The host part of a Host header's value (no port, no brackets), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_name(host: str) -> bool:
    name = _hostname(host)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check(headers: Mapping[str, str], scheme: str, peer_host: str | None) -> None:
    """CrossSite unless the request passes both rules above (call only when no token is needed)."""
    host = headers.get("host", "")
    origin = headers.get("origin")
    if origin is not None:
        o = urlsplit(origin)
        if origin == "null" or o.scheme != scheme or o.netloc.lower() != host.strip().lower():
            raise CrossSite(f"cross-site request refused: Origin {origin[:100]!r} is not {scheme}://{host[:100]} "
                            "(no token guards this API: set auth.tokens_file to serve browsers)")
    if peer_host is not None and is_loopback_name(peer_host) and not is_loopback_name(host):
        raise CrossSite(f"request refused: Host {host[:100]!r} is not a loopback name (a rebound DNS name?); "
                        "use 127.0.0.1 or localhost")
