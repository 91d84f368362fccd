from __future__ import annotations

import pytest

from edgespec.errors import ConfigError
from edgespec.server.auth import TokenAuth, hash_token, read_hashes


def test_token_auth_rules(tmp_path):
    a = TokenAuth(tokens=(hash_token("u"),), admin_tokens=(hash_token("a"),))
    inf, adm, hc = "/edgespec.v1.Inference/Generate", "/edgespec.v1.Admin/Stats", "/grpc.health.v1.Health/Check"
    assert a.check(hc, None) is None
    assert a.check(inf, None) == "unauthenticated"
    assert a.check(inf, "Bearer nope") == "unauthenticated"
    assert a.check(inf, "Basic u") == "unauthenticated"
    assert a.check(inf, "Bearer u") is None and a.check(inf, "bearer a") is None
    assert a.check(adm, "Bearer u") == "permission_denied"
    assert a.check(adm, "Bearer a") is None
    assert TokenAuth().check(adm, None) is None  # no tokens configured: open (loopback only, see config)


def test_read_hashes(tmp_path):
    f = tmp_path / "t"
    f.write_text(f"# comment\n\n{hash_token('x').upper()}  # trailing\n")
    assert read_hashes(f) == (hash_token("x"),)
    f.write_text("plaintext-token\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_hashes(f)
