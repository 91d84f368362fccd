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


@pytest.mark.parametrize("text", ["", "# every token revoked\n\n", "   \n"])
def test_a_token_file_without_a_hash_is_a_configuration_error(tmp_path, text):
    """Empty, comment-only or truncated to nothing: refused at start and in `config validate`,
    never read as "no tokens, everyone allowed" (with or without an admin file beside it)."""
    from edgespec.server.config import InvalidConfig, load

    empty, admins = tmp_path / "tokens", tmp_path / "admins"
    empty.write_text(text)
    admins.write_text(hash_token("a") + "\n")
    for files in ({"tokens_file": str(empty)}, {"admin_tokens_file": str(empty)},
                  {"tokens_file": str(empty), "admin_tokens_file": str(admins)}):
        with pytest.raises(ConfigError, match="no token hash"):
            TokenAuth.from_files(**files)
        with pytest.raises(InvalidConfig) as e:
            load(None, env={}, overrides={"server": {"host": "0.0.0.0"}, "auth": files})
        assert [k for k, _ in e.value.problems] == [f"auth.{k}" for k, v in files.items() if v == str(empty)]


def test_configured_token_files_fail_closed_whatever_they_hold():
    """A TokenAuth whose files were configured allows no one without a valid token even if no
    hash was loaded: Admin, Inference and the HTTP API refuse; Health stays open."""
    a = TokenAuth(required=True)
    assert a.enabled and a.has_tokens
    for method in ("/edgespec.v1.Inference/Generate", "/edgespec.v1.Admin/Drain", "/edgespec.v1.Inference/HTTP"):
        assert a.check(method, None) == "unauthenticated"
        assert a.check(method, "Bearer anything") == "unauthenticated"
    assert a.check("/grpc.health.v1.Health/Check", None) is None
