"""Who is calling, and may they: bearer tokens and verified client certificates.

Token files hold sha256 hex hashes, one per line (`#` comments), optionally named: `name:hash`
(`edgespec config hash-token --name N`); a presented token is hashed and compared against every
stored hash in constant time. Under mutual TLS a verified client certificate is an identity too
(its subject). Admin tokens and the certificates in `[auth] admin_subjects` (a whole subject, or
`CN:<name>`) may call
everything; other callers everything but the Admin service. Health is always open. The caller's
identity (a token's name, never the token; a certificate's subject) goes into every request's log
line."""

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


def unnamed(h: str) -> str:
    """The name of an unnamed token: derived from its hash (`sha-` and 12 hex digits of a
    domain-separated digest), so it stays the same wherever the line moves and whichever file holds
    it; it identifies the token in logs and limits without repeating the stored hash."""
    return "sha-" + hashlib.sha256(b"edgespec token name\0" + h.encode()).hexdigest()[:12]


def read_named_hashes(path: str | Path) -> tuple[tuple[str, str], ...]:
    """(name, hash) per line; an unnamed hash is named after the hash (`unnamed`)."""
    out = []
    p = Path(path).expanduser()
    for n, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, h = line.rpartition(":")
        name, h = name.strip(), h.strip().lower()
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise ConfigError(str(path), f"line {n}: expected a sha256 hex hash or name:hash (use `edgespec config hash-token`)")
        if sep and not valid_name(name):
            raise ConfigError(str(path), f"line {n}: a token name is 1-64 characters of [A-Za-z0-9-_.@], got {name!r}")
        out.append((name or unnamed(h), h))
    return tuple(out)


def read_token_file(path: str | Path) -> tuple[tuple[str, str], ...]:
    """read_named_hashes of a configured token file, which must hold at least one hash: an empty,
    comment-only or truncated file is a ConfigError (at start, in `config validate` and on reload),
    never a daemon that answers everyone because no hash was loaded."""
    out = read_named_hashes(path)
    if not out:
        raise ConfigError(str(path), "holds no token hash (an empty or truncated file locks nobody out: unset the "
                          "setting to turn tokens off, or add a hash with `edgespec config hash-token`)")
    return out


def read_hashes(path: str | Path) -> tuple[str, ...]:
    return tuple(h for _, h in read_token_file(path))


def valid_name(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_.@") for c in name)


def _matches(presented_hash: str, stored: tuple[str, ...]) -> bool:
    found = False
    for h in stored:  # no early exit: time does not depend on which hash matched
        found |= hmac.compare_digest(presented_hash, h)
    return found


@dataclass(frozen=True)
class Decision:
    verdict: str | None  # None = allowed, "unauthenticated", "permission_denied"
    identity: str  # "token:<name>", "cert:<subject>", "invalid-token" or "anonymous"; never a secret
    admin: bool = False

    @property
    def identified(self) -> bool:
        """A valid token or a verified certificate: not an anonymous caller."""
        return self.identity.startswith(("token:", "cert:"))


@dataclass(frozen=True)
class TokenAuth:
    tokens: tuple[str, ...] = ()
    admin_tokens: tuple[str, ...] = ()
    names: tuple[tuple[str, str], ...] = ()  # (hash, name) of every token
    client_certs: bool = False  # mutual TLS: a verified client certificate is an identity
    admin_subjects: tuple[str, ...] = ()  # whole subjects, or "CN:<name>" entries, with admin rights
    # token files are configured: callers must present a token (or a certificate), whatever the
    # files held. Fail closed: no loaded hash never means "everyone"
    required: bool = False
    metrics_tokens: tuple[str, ...] = ()  # scrape tokens: /metrics only, without per-caller figures

    @classmethod
    def from_files(cls, tokens_file: str = "", admin_tokens_file: str = "", *, client_certs: bool = False,
                   admin_subjects: tuple[str, ...] = (), metrics_tokens_file: str = "") -> TokenAuth:
        users = read_token_file(tokens_file) if tokens_file else ()
        admins = read_token_file(admin_tokens_file) if admin_tokens_file else ()
        scrapers = read_token_file(metrics_tokens_file) if metrics_tokens_file else ()
        owner: dict[str, str] = {}
        for path, entries in ((tokens_file, users), (admin_tokens_file, admins), (metrics_tokens_file, scrapers)):
            for name, h in entries:
                if owner.setdefault(name, h) != h:  # one name, two tokens: one identity for both
                    raise ConfigError(str(path), f"the token name {name!r} is given to two different tokens "
                                      "(in this file or the other token file): names must be unique")
        return cls(
            tokens=tuple(h for _, h in users),
            admin_tokens=tuple(h for _, h in admins),
            names=tuple((h, name) for name, h in (*users, *admins)),
            client_certs=client_certs,
            admin_subjects=tuple(admin_subjects),
            required=bool(tokens_file or admin_tokens_file),
            metrics_tokens=tuple(h for _, h in scrapers),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.required or self.tokens or self.admin_tokens or self.client_certs)

    @property
    def has_tokens(self) -> bool:
        """Bearer tokens are in force (token files configured, or hashes given): /metrics asks for one."""
        return bool(self.required or self.tokens or self.admin_tokens)

    def scrape(self, authorization: str | None, subject: tuple[str, str] | None = None) -> str | None:
        """What a /metrics request may read: "all" (an admin token or admin certificate, or no
        tokens configured at all), "shared" (a metrics token: everything but the per-caller
        figures, which name other tenants and their traffic), or None (refused: no token, a user
        token, another certificate). A scrape token sniffed off plain HTTP grants no inference."""
        token = _bearer(authorization)
        if token is not None:
            h = hash_token(token)
            if _matches(h, self.admin_tokens):
                return "all"
            return "shared" if _matches(h, self.metrics_tokens) else None
        if subject is not None and self.client_certs and self.admin_subject(*subject):
            return "all"
        return None if (self.has_tokens or self.metrics_tokens or self.client_certs) else "all"

    def needs_subject(self, authorization: str | None) -> bool:
        """Whether decide() depends on the client certificate: no bearer token, under mutual TLS.
        Otherwise the decision can be made from the metadata alone, before any request message."""
        return self.client_certs and _bearer(authorization) is None

    def check(self, method: str, authorization: str | None) -> str | None:
        """None when allowed, else "unauthenticated" or "permission_denied".

        `method` is the full gRPC method ("/pkg.Service/Method").
        """
        return self.decide(method, authorization).verdict

    def decide(self, method: str, authorization: str | None, subject: tuple[str, str] | None = None) -> Decision:
        """`subject`: (subject, common name) of the verified client certificate, when there is one.
        A bearer token, when sent, decides; else the certificate (under mutual TLS)."""
        service = method.lstrip("/").split("/", 1)[0]
        token = _bearer(authorization)
        who = "anonymous"
        if token is not None:
            h = hash_token(token)
            is_admin, is_user = _matches(h, self.admin_tokens), _matches(h, self.tokens)
            if is_admin or is_user:
                name = next((n for k, n in self.names if hmac.compare_digest(k, h)), "unnamed")
                return self._allow(service, f"token:{name}", is_admin)
            who = "invalid-token"
        elif subject is not None and self.client_certs:
            full, cn = subject
            return self._allow(service, f"cert:{full or cn}", self.admin_subject(full, cn))
        if service in OPEN_SERVICES or not self.enabled:
            return Decision(None, who)
        return Decision("unauthenticated", who)

    def admin_subject(self, full: str, cn: str) -> bool:
        """Whether a verified certificate has admin rights: an `[auth] admin_subjects` entry equal to
        its whole subject (RFC 4514, escaped), or an entry `CN:<name>` equal to its common name.
        Never a subject against a CN entry or a CN against a subject entry: a certificate whose CN
        is literally "CN=ops,O=site" is not the subject "CN=ops,O=site"."""
        return any(e == f"CN:{cn}" if e.startswith("CN:") else e == full for e in self.admin_subjects) \
            if (full or cn) else False

    @staticmethod
    def _allow(service: str, identity: str, admin: bool) -> Decision:
        if service == ADMIN_SERVICE and not admin:
            return Decision("permission_denied", identity)
        return Decision(None, identity, admin)


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
