"""Client side: a channel to the daemon with optional TLS / mutual TLS and a bearer token.
Used by `edgespec client`, `edgespec health|stats`, tools/soak.py and the tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class ClientOptions:
    addr: str = "127.0.0.1:50051"
    token: str = ""
    ca: str = ""  # PEM of the CA that signed the server certificate; set = TLS
    cert: str = ""  # client certificate (mutual TLS)
    key: str = ""  # client key (mutual TLS)
    server_name: str = ""  # TLS name override (e.g. "localhost" when dialling 127.0.0.1)
    max_message_bytes: int = 64 << 20

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def open_channel(o: ClientOptions) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", o.max_message_bytes),
               ("grpc.max_send_message_length", o.max_message_bytes)]
    if o.server_name:
        options.append(("grpc.ssl_target_name_override", o.server_name))
    if o.ca or o.cert:
        read = lambda p: Path(p).expanduser().read_bytes() if p else None  # noqa: E731
        creds = grpc.ssl_channel_credentials(root_certificates=read(o.ca), private_key=read(o.key),
                                             certificate_chain=read(o.cert))
        return grpc.secure_channel(o.addr, creds, options=options)
    return grpc.insecure_channel(o.addr, options=options)
