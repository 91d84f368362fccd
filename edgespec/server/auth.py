"""Bearer-token auth: token files hold sha256 hex hashes (one per line, `#` comments); a presented
token is hashed and compared against every stored hash in constant time. Admin tokens may call
everything; plain tokens everything but the Admin service. Health is always open."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import ConfigError

OPEN_SERVICES = ("grpc.health.v1.Health",)
ADMIN_SERVICE = "edgespec.v1.Admin"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def read_hashes(path: str | Path) -> tuple[str, ...]:
    out = []
    for n, line in enumerate(Path(path).expanduser().read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip().lower()
        if not line:
            continue
        if len(line) != 64 or any(c not in "0123456789abcdef" for c in line):
            raise ConfigError(str(path), f"line {n}: expected a sha256 hex hash (use `edgespec config hash-token`)")
        out.append(line)
    return tuple(out)


def _matches(presented_hash: str, stored: tuple[str, ...]) -> bool:
    found = False
    for h in stored:  # no early exit: time does not depend on which hash matched
        found |= hmac.compare_digest(presented_hash, h)
    return found


@dataclass(frozen=True)
class TokenAuth:
    tokens: tuple[str, ...] = ()
    admin_tokens: tuple[str, ...] = ()

    @classmethod
    def from_files(cls, tokens_file: str = "", admin_tokens_file: str = "") -> "TokenAuth":
        return cls(
            tokens=read_hashes(tokens_file) if tokens_file else (),
            admin_tokens=read_hashes(admin_tokens_file) if admin_tokens_file else (),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.tokens or self.admin_tokens)

    def check(self, method: str, authorization: str | None) -> str | None:
        """None when allowed, else "unauthenticated" or "permission_denied".

        `method` is the full gRPC method ("/pkg.Service/Method").
        """
        if not self.enabled:
            return None
        service = method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES:
            return None
        token = _bearer(authorization)
        if token is None:
            return "unauthenticated"
        h = hash_token(token)
        is_admin = _matches(h, self.admin_tokens)
        is_user = _matches(h, self.tokens)
        if not (is_admin or is_user):
            return "unauthenticated"
        if service == ADMIN_SERVICE and not is_admin:
            return "permission_denied"
        return None


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
