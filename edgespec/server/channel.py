"""Client side: a channel to the daemon with optional TLS / mutual TLS and a bearer token.
Used by `edgespec client`, `edgespec health|stats` and the tests.

Several appliances: `addr` may list several addresses (`10.0.0.5:50051,10.0.0.6:50051`) or name a
DNS record gRPC resolves and re-resolves (`dns:///edgespec.site:50051`, one A/AAAA record per
appliance). Such a channel balances with gRPC's own `round_robin` policy, watches every replica's
health (the standard health service, for `edgespec.v1.Inference`) so a loading or draining
appliance gets no request, and retries a call that failed UNAVAILABLE before any response
reached the caller (a killed or unreachable replica) on another one: SERVICE_CONFIG below, the
same document Go, Java or C++ callers pass (docs/appliance.md).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

from edgespec.errors import BadRequest

HEALTH_SERVICE = "edgespec.v1.Inference"
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": HEALTH_SERVICE},
    "methodConfig": [{
        "name": [{"service": "edgespec.v1.Inference"}, {"service": "edgespec.v1.Admin"}],
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
}


@dataclass(frozen=True)
class ClientOptions:
    addr: str = "127.0.0.1:50051"  # host:port, a comma-separated list of them, or dns:///name:port
    token: str = ""
    ca: str = ""  # PEM of the CA that signed the server certificate; set = TLS
    cert: str = ""  # client certificate (mutual TLS)
    key: str = ""  # client key (mutual TLS)
    server_name: str = ""  # TLS name override (e.g. "localhost" when dialling 127.0.0.1)
    max_message_bytes: int = 64 << 20

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def _split(hostport: str) -> tuple[str, int]:
    host, sep, port = hostport.strip().rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise BadRequest("--addr", f"expected host:port, got {hostport!r}")
    return host.strip("[]"), int(port)


def resolve_target(addr: str) -> tuple[str, bool]:
    """(gRPC target, balanced?). One host:port stays as it is (pick_first, as before); a list
    becomes an `ipv4:`/`ipv6:` target of every address (names resolved once, here: use
    dns:/// for a set that changes); `dns:` and other gRPC URIs are passed through, balanced."""
    addr = addr.strip()
    if "://" in addr or addr.startswith(("dns:", "ipv4:", "ipv6:", "unix:")):
        return addr, addr.startswith(("dns:", "ipv4:", "ipv6:"))
    parts = [p for p in addr.split(",") if p.strip()]
    if len(parts) == 1:
        _split(parts[0])
        return parts[0].strip(), False
    v4: list[str] = []
    v6: list[str] = []
    for part in parts:
        host, port = _split(part)
        try:
            ips = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                ips = [ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
            except socket.gaierror as exc:
                raise BadRequest("--addr", f"cannot resolve {host!r}: {exc.strerror}") from None
        for ip in dict.fromkeys(ips):
            (v4 if ip.version == 4 else v6).append(f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")
    if v4 and v6:  # one gRPC target holds one address family
        v6 = []
    return ("ipv4:" + ",".join(v4)) if v4 else ("ipv6:" + ",".join(v6)), True


def open_channel(o: ClientOptions) -> grpc.Channel:
    target, balanced = resolve_target(o.addr)
    options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", o.max_message_bytes),
               ("grpc.max_send_message_length", o.max_message_bytes)]
    if balanced:
        options += [("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1)]
    if o.server_name:
        options.append(("grpc.ssl_target_name_override", o.server_name))
    if o.ca or o.cert:
        read = lambda p: Path(p).expanduser().read_bytes() if p else None
        creds = grpc.ssl_channel_credentials(root_certificates=read(o.ca), private_key=read(o.key),
                                             certificate_chain=read(o.cert))
        return grpc.secure_channel(target, creds, options=options)
    return grpc.insecure_channel(target, options=options)
