"""Audit and identity: every RPC's log line names the peer, the caller (a token's name or a client
certificate's subject, never the secret) and the caller's x-request-id, which comes back in
trailing metadata; ModelInfo reports the models' manifest names and digests; under mutual TLS a
verified certificate is an identity with admin rights only for `auth.admin_subjects`. Real
daemons on loopback (fake engine), real certificates."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from edgespec.errors import ConfigError
from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server.auth import TokenAuth, hash_token, read_named_hashes, unnamed
from edgespec.server.channel import ClientOptions, open_channel
from edgespec.server.config import InvalidConfig, load
from tests.server.test_daemon import req

INF, ADM, HC = "/edgespec.v1.Inference/Generate", "/edgespec.v1.Admin/Stats", "/grpc.health.v1.Health/Check"
USER_SECRET, ADMIN_SECRET = "user-secret-7f3a", "admin-secret-91bc"
ADMIN_ID = f"token:{unnamed(hash_token(ADMIN_SECRET))}"  # the unnamed admin token's identity


@pytest.fixture
def logs():
    """Every log entry (debug and up) as a dict, with the contextvars bound at the time."""
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as cap:
            yield cap
    finally:
        structlog.configure(**old)


def rpc_lines(entries: list[dict], method: str) -> list[dict]:
    return [e for e in entries if e["event"] == "rpc" and e["method"] == method]


@pytest.fixture
def named_tokens(tmp_path):
    user, admin = tmp_path / "tokens", tmp_path / "admin_tokens"
    user.write_text(f"# who calls\nops-dashboard:{hash_token(USER_SECRET)}  # the dashboard\n")
    admin.write_text(hash_token(ADMIN_SECRET) + "\n")  # unnamed: named after its hash
    return {"tokens_file": str(user), "admin_tokens_file": str(admin)}


# ---- pure rules -------------------------------------------------------------------------------


def test_an_unnamed_tokens_identity_is_its_own_wherever_its_line_is(tmp_path):
    """Named after its hash, not its file and line: an edited file keeps every identity (and with
    it limits, cache partitions, the suffix-cache snapshot), and a user file and an admin file of
    the same basename give two tokens two identities. A name given to two tokens is refused."""
    (tmp_path / "u").mkdir()
    (tmp_path / "a").mkdir()
    users, admins = tmp_path / "u" / "tokens", tmp_path / "a" / "tokens"
    users.write_text(f"{hash_token('t1')}\n{hash_token('t2')}\n")
    admins.write_text(f"{hash_token('t3')}\n")
    auth = TokenAuth.from_files(str(users), str(admins))
    before = {t: auth.decide(INF, f"Bearer {t}").identity for t in ("t1", "t2", "t3")}
    assert len(set(before.values())) == 3 and all(v.startswith("token:sha-") for v in before.values())
    users.write_text(f"# a comment now\n{hash_token('t2')}\n\n{hash_token('t1')}\n")
    auth = TokenAuth.from_files(str(users), str(admins))
    assert {t: auth.decide(INF, f"Bearer {t}").identity for t in ("t1", "t2", "t3")} == before
    assert not any(hash_token(t) in v for t, v in before.items())  # the stored hash is not the name
    admins.write_text(f"ops:{hash_token('t3')}\n")
    users.write_text(f"ops:{hash_token('t1')}\n")
    with pytest.raises(ConfigError, match="'ops' is given to two different tokens"):
        TokenAuth.from_files(str(users), str(admins))



def test_named_hashes_and_decisions(tmp_path, named_tokens):
    assert read_named_hashes(named_tokens["tokens_file"]) == (("ops-dashboard", hash_token(USER_SECRET)),)
    bad = tmp_path / "bad"
    bad.write_text(f"two words:{hash_token('x')}\n")
    with pytest.raises(ConfigError, match="line 1: a token name"):
        read_named_hashes(bad)
    a = TokenAuth.from_files(**named_tokens, client_certs=True, admin_subjects=("CN:ops team",))
    d = a.decide(INF, f"Bearer {USER_SECRET}")
    assert (d.verdict, d.identity, d.admin) == (None, "token:ops-dashboard", False)
    assert a.decide(ADM, f"Bearer {ADMIN_SECRET}").identity == ADMIN_ID
    assert a.decide(ADM, f"Bearer {USER_SECRET}").verdict == "permission_denied"
    cert = ("CN=ops team,O=site", "ops team")
    assert a.decide(ADM, None, cert).verdict is None  # admin by common name
    assert a.decide(ADM, None, cert).identity == "cert:CN=ops team,O=site"
    assert TokenAuth(client_certs=True, admin_subjects=("CN=ops team,O=site",)).decide(ADM, None, cert).admin
    other = ("CN=batch,O=site", "batch")
    assert a.decide(INF, None, other).verdict is None and a.decide(ADM, None, other).verdict == "permission_denied"
    assert a.decide(INF, "Bearer wrong", cert).verdict == "unauthenticated"  # a bad token is not excused by a cert
    assert a.decide(INF, None).verdict == "unauthenticated"
    assert a.decide(HC, None).verdict is None
    # without mutual TLS a certificate subject means nothing
    assert TokenAuth.from_files(**named_tokens).decide(INF, None, cert).verdict == "unauthenticated"


def test_no_non_loopback_bind_without_authentication(tmp_path, named_tokens):
    ca = tmp_path / "ca.pem"
    ca.write_text("-")
    cert = {"cert": str(ca), "key": str(ca)}
    with pytest.raises(InvalidConfig, match="server.host: 0.0.0.0 is not a loopback address and no authentication"):
        load(None, env={}, overrides={"server": {"host": "0.0.0.0"}})
    with pytest.raises(InvalidConfig, match="server.host"):
        load(None, env={}, overrides={"server": {"host": "0.0.0.0"}, "tls": cert})  # TLS alone is no identity
    load(None, env={}, overrides={"server": {"host": "0.0.0.0"}, "tls": {**cert, "client_ca": str(ca)}})
    load(None, env={}, overrides={"server": {"host": "0.0.0.0"}, "auth": named_tokens})
    load(None, env={}, overrides={"server": {"host": "0.0.0.0", "insecure": True}})
    with pytest.raises(InvalidConfig, match="auth.admin_subjects: certificate subjects need mutual TLS"):
        load(None, env={}, overrides={"auth": {"admin_subjects": ["CN:ops"]}})
    with pytest.raises(InvalidConfig, match="auth.admin_subjects"):
        load(None, env={}, overrides={"auth": {"admin_subjects": [""]}, "tls": {**cert, "client_ca": str(ca)}})
    env = {"EDGESPEC_AUTH_ADMIN_SUBJECTS": "CN:ops team, CN=x"}
    got = load(None, env=env, overrides={"tls": {**cert, "client_ca": str(ca)}}).auth.admin_subjects
    assert got == ("CN:ops team", "CN=x")


# ---- through a daemon -----------------------------------------------------------------------


def test_log_lines_name_peer_caller_and_request_id_never_the_secret(make_daemon, named_tokens, logs):
    r = make_daemon(auth=named_tokens)
    user = (("authorization", f"Bearer {USER_SECRET}"), ("x-request-id", "trace-42"))
    resp, call = r.inference.Generate.with_call(req(max_tokens=2), timeout=5, metadata=user)
    assert resp.request_id == "trace-42"  # the job takes the caller's id when the request has none
    assert ("x-request-id", "trace-42") in tuple(call.trailing_metadata())
    stream = r.inference.GenerateStream(req(max_tokens=3), timeout=5,
                                        metadata=(user[0], ("x-request-id", "trace-43")))
    assert [m.request_id for m in stream] and ("x-request-id", "trace-43") in tuple(stream.trailing_metadata())
    own = req(max_tokens=2)
    own.request_id = "job-1"
    assert r.inference.Generate(own, timeout=5, metadata=user).request_id == "job-1"
    r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=(("authorization", f"Bearer {ADMIN_SECRET}"),))
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=2), timeout=5, metadata=(("authorization", "Bearer guess"),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=2), timeout=5, metadata=(user[0], ("x-request-id", "a b")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-request-id" in e.value.details()

    gen = rpc_lines(logs, INF)
    assert [(g["caller"], g.get("x_request_id"), g["request_id"], g["code"]) for g in gen[:2]] == [
        ("token:ops-dashboard", "trace-42", "trace-42", "OK"), ("token:ops-dashboard", "trace-42", "job-1", "OK")]
    assert [(g["caller"], g.get("x_request_id"), g["code"]) for g in gen[2:]] == [
        ("invalid-token", None, "UNAUTHENTICATED"), ("token:ops-dashboard", None, "INVALID_ARGUMENT")]
    assert all(g["peer"].startswith("ipv4:127.0.0.1:") for g in gen)
    (st,) = rpc_lines(logs, "/edgespec.v1.Inference/GenerateStream")
    assert (st["caller"], st["x_request_id"], st["code"]) == ("token:ops-dashboard", "trace-43", "OK")
    (adm,) = rpc_lines(logs, ADM)
    assert adm["caller"] == ADMIN_ID
    assert USER_SECRET not in repr(logs) and ADMIN_SECRET not in repr(logs) and hash_token(USER_SECRET) not in repr(logs)


def test_model_info_reports_manifest_names_and_digests(make_daemon, tmp_path):
    from edgespec.models import add_model, sha256_file
    from tests.test_models_registry import write_gguf

    models = tmp_path / "models"
    e = add_model(write_gguf(tmp_path / "t.gguf"), role="target", name="site-target", directory=models)
    unlisted = write_gguf(tmp_path / "elsewhere.gguf", fill=1.0)
    r = make_daemon(target={"path": str(models / e.name)}, draft={"path": str(unlisted)})
    info = r.inference.ModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert (info.target_name, info.target_sha256) == ("site-target.gguf", sha256_file(models / e.name))
    assert (info.draft_name, info.draft_sha256) == ("", "")  # not hashed at load


def test_client_certificate_is_an_identity_and_admin_by_subject(make_daemon, certs, named_tokens, logs):
    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"]), "client_ca": str(certs["ca"])}
    addr = lambda r: f"localhost:{r.daemon.port}"
    client = dict(ca=str(certs["ca"]), cert=str(certs["client_cert"]), key=str(certs["client_key"]))

    plain = make_daemon(tls=tls, auth=named_tokens)  # tokens and mTLS, no admin subjects
    with open_channel(ClientOptions(addr=addr(plain), **client)) as ch:
        assert inference_pb2_grpc.InferenceStub(ch).Generate(req(max_tokens=2), timeout=5).text  # no token needed
        with pytest.raises(grpc.RpcError) as e:
            admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with open_channel(ClientOptions(addr=addr(plain), token=ADMIN_SECRET, **client)) as ch:  # a token over mTLS
        assert admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=5,
                                                 metadata=(("authorization", f"Bearer {ADMIN_SECRET}"),)).ready

    ops = make_daemon(tls=tls, auth={"admin_subjects": ["CN=edgespec client"]})
    with open_channel(ClientOptions(addr=addr(ops), **client)) as ch:
        assert admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=5).ready
    callers = [(e["method"], e["caller"], e["code"]) for e in logs if e["event"] == "rpc"]
    assert callers == [
        (INF, "cert:CN=edgespec client", "OK"), (ADM, "cert:CN=edgespec client", "PERMISSION_DENIED"),
        (ADM, ADMIN_ID, "OK"), (ADM, "cert:CN=edgespec client", "OK")]


def test_reload_swaps_tokens_and_a_failed_one_changes_nothing(make_daemon, named_tokens, tmp_path):
    r = make_daemon(auth=named_tokens)
    admin = (("authorization", f"Bearer {ADMIN_SECRET}"),)
    assert not r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=admin).HasField("last_reload")
    Path(named_tokens["tokens_file"]).write_text(f"next:{hash_token('next-secret')}\n")
    assert r.daemon.reload()
    ok = lambda token: r.inference.Generate(req(max_tokens=2), timeout=5,
                                            metadata=(("authorization", f"Bearer {token}"),)).text
    assert ok("next-secret")
    with pytest.raises(grpc.RpcError) as e:
        ok(USER_SECRET)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    st = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=admin).last_reload
    assert st.ok and list(st.reloaded) == ["auth"] and st.source == ""  # no config file: the same files re-read
    Path(named_tokens["tokens_file"]).write_text("not a hash\n")
    assert not r.daemon.reload()
    assert ok("next-secret")  # unchanged
    st = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=admin).last_reload
    assert not st.ok and "line 1" in st.error and named_tokens["tokens_file"] in st.error


def test_anonymous_health_calls_are_capped_and_still_audited(make_daemon, named_tokens, logs):
    """Where the audit log meets the anonymous-call cap: a token-less health call runs on the
    anonymous pool, takes a slot, and still gets its `rpc` line (peer, caller, x-request-id echoed);
    a call refused for the cap gets one too; a named token's health call is authorised work."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.server.test_daemon import wait_for

    r = make_daemon(auth=named_tokens, limits={"anonymous_rpcs": 1})
    health = health_pb2_grpc.HealthStub(r.channel)
    _, call = health.Check.with_call(health_pb2.HealthCheckRequest(), timeout=5,
                                     metadata=(("x-request-id", "probe-1"),))
    assert ("x-request-id", "probe-1") in tuple(call.trailing_metadata())
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    next(watch)
    assert r.daemon._interceptor.anonymous.in_use == 1
    with pytest.raises(grpc.RpcError) as e:
        health.Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=(("authorization", "Bearer guess"),))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    user = (("authorization", f"Bearer {USER_SECRET}"),)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=user).status  # not capped
    watch.cancel()
    assert wait_for(lambda: r.daemon._interceptor.anonymous.in_use == 0)
    assert wait_for(lambda: len(rpc_lines(logs, "/grpc.health.v1.Health/Watch")) == 1)
    checks = [(g["caller"], g.get("x_request_id"), g["code"]) for g in rpc_lines(logs, HC)]
    assert checks == [("anonymous", "probe-1", "OK"), ("invalid-token", None, "RESOURCE_EXHAUSTED"),
                      ("token:ops-dashboard", None, "OK")]
    (w,) = rpc_lines(logs, "/grpc.health.v1.Health/Watch")
    assert w["caller"] == "anonymous" and w["peer"].startswith("ipv4:127.0.0.1:")
    assert all(g["peer"].startswith("ipv4:127.0.0.1:") for g in rpc_lines(logs, HC))


def test_a_certificate_holder_is_no_anonymous_caller(make_daemon, certs, logs):
    """Under mutual TLS a token-less call is decided in its handler by the certificate (grpc shows
    it only there): its health calls are authorised work, never counted against the cap."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"]), "client_ca": str(certs["ca"])}
    r = make_daemon(tls=tls, limits={"anonymous_rpcs": 1})
    client = dict(ca=str(certs["ca"]), cert=str(certs["client_cert"]), key=str(certs["client_key"]))
    with open_channel(ClientOptions(addr=f"localhost:{r.daemon.port}", **client)) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(3)]
        assert all(next(w).status for w in watches) and r.daemon._interceptor.anonymous.in_use == 0
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        for w in watches:
            w.cancel()
    (line,) = rpc_lines(logs, HC)
    assert line["caller"] == "cert:CN=edgespec client" and line["code"] == "OK"


def test_http_lines_name_peer_caller_and_request_id_as_grpc_does(make_daemon, named_tokens, logs):
    import json as _json

    from tests.server.test_http import HTTP, MODEL, raw

    r = make_daemon(auth=named_tokens, http=HTTP)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    status, headers, _ = raw(r, "POST", "/v1/chat/completions", body,
                             {"Authorization": f"Bearer {USER_SECRET}", "x-request-id": "trace-7"})
    assert status == 200 and headers["x-request-id"] == "trace-7"
    status, _, out = raw(r, "POST", "/v1/chat/completions", body,
                         {"Authorization": f"Bearer {USER_SECRET}", "x-request-id": "a b"})
    assert status == 400 and _json.loads(out)["error"]["param"] == "x-request-id"  # as gRPC's INVALID_ARGUMENT
    status, _, _ = raw(r, "POST", "/v1/chat/completions", body, {"Authorization": "Bearer guess"})
    assert status == 401
    lines = [e for e in logs if e["event"] == "http" and e["path"] == "/v1/chat/completions"]
    assert [(e["caller"], e.get("x_request_id"), e["status"]) for e in lines] == [
        ("token:ops-dashboard", "trace-7", 200), ("token:ops-dashboard", None, 400), ("invalid-token", None, 401)]
    assert all(e["peer"].startswith("ipv4:127.0.0.1:") for e in lines) and lines[0]["request_id"] == "trace-7"
    assert USER_SECRET not in repr(logs)


# ---- mutual TLS: one rule for admin, escaped subjects, a removed CA revoked ---------------------


def test_admin_by_whole_subject_or_an_explicit_cn_entry_never_across():
    """An entry is a whole subject (matched exactly) or `CN:<name>` (matched against the common
    name): a certificate whose CN is literally "ops,O=site" (its subject, escaped as RFC 4514 and
    grpc write it: "CN=ops\\,O=site") is not the subject "CN=ops,O=site"; a bare name is refused."""
    from edgespec.server.http_server import cert_subject

    trick = cert_subject({"subject": ((("organizationName", "site"),), (("commonName", "ops,O=site"),))})
    assert trick == ("CN=ops\\,O=site,O=site", "ops,O=site")
    assert cert_subject({"subject": ((("commonName", " #a+b;<c> "),),)}) == ("CN=\\ #a\\+b\\;\\<c\\>\\ ", " #a+b;<c> ")
    by_subject = TokenAuth(client_certs=True, admin_subjects=("CN=ops,O=site",))
    assert not by_subject.decide(ADM, None, ("CN=ops\\,O=site", "ops,O=site")).admin
    assert not by_subject.decide(ADM, None, ("CN=x,O=y", "CN=ops,O=site")).admin  # a CN against a subject entry
    assert by_subject.decide(ADM, None, ("CN=ops,O=site", "ops")).admin
    by_cn = TokenAuth(client_certs=True, admin_subjects=("CN:ops",))
    assert by_cn.decide(ADM, None, ("CN=ops,O=site", "ops")).admin
    assert not by_cn.decide(ADM, None, ("CN=opsx,O=site", "opsx")).admin
    assert not TokenAuth(client_certs=True, admin_subjects=("ops",)).decide(ADM, None, ("CN=ops", "ops")).admin


def test_a_bare_name_in_admin_subjects_is_a_config_error(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-")
    tls = {"cert": str(ca), "key": str(ca), "client_ca": str(ca)}
    with pytest.raises(InvalidConfig, match="auth.admin_subjects.*CN:<common name>"):
        load(None, env={}, overrides={"auth": {"admin_subjects": ["ops team"]}, "tls": tls})
    with pytest.raises(InvalidConfig, match="auth.admin_subjects"):
        load(None, env={}, overrides={"auth": {"admin_subjects": ["CN:"]}, "tls": tls})
    assert load(None, env={}, overrides={"auth": {"admin_subjects": ["CN:ops team", "CN=x,O=y"]},
                                         "tls": tls}).auth.admin_subjects == ("CN:ops team", "CN=x,O=y")


def test_a_certificate_whose_cn_spells_a_subject_is_not_that_subject_over_grpc(make_daemon, certs):
    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"]), "client_ca": str(certs["ca"])}
    r = make_daemon(tls=tls, auth={"admin_subjects": ["CN=ops,O=site"]})
    trick = ClientOptions(addr=f"localhost:{r.daemon.port}", ca=str(certs["ca"]), cert=str(certs["trick_cert"]),
                          key=str(certs["trick_key"]))
    with open_channel(trick) as ch:
        assert inference_pb2_grpc.InferenceStub(ch).Generate(req(max_tokens=2), timeout=5).text
        with pytest.raises(grpc.RpcError) as e:
            admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_ca_removed_from_client_ca_is_revoked_on_reload_over_https_and_grpc(make_daemon, certs, tmp_path):
    import http.client
    import ssl

    from tests.server.test_http import HTTP

    bundle = tmp_path / "client_ca.pem"
    bundle.write_text(certs["ca"].read_text() + certs["ca2"].read_text())
    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"]), "client_ca": str(bundle)}
    r = make_daemon(http=HTTP, tls=tls)

    def https(cert: str, key: str) -> int:
        ctx = ssl.create_default_context(cafile=str(certs["ca"]))
        ctx.load_cert_chain(cert, key)
        conn = http.client.HTTPSConnection("localhost", r.daemon.http_port, context=ctx, timeout=10)
        try:
            conn.request("GET", "/v1/models")
            return conn.getresponse().status
        finally:
            conn.close()

    def grpc_ok(cert: str, key: str) -> bool:
        opts = ClientOptions(addr=f"localhost:{r.daemon.port}", ca=str(certs["ca"]), cert=cert, key=key)
        with open_channel(opts) as ch:
            try:
                return bool(inference_pb2_grpc.InferenceStub(ch).Generate(req(max_tokens=2), timeout=5).text)
            except grpc.RpcError:
                return False

    one, two = (str(certs["client_cert"]), str(certs["client_key"])), (str(certs["client2_cert"]), str(certs["client2_key"]))
    assert https(*two) == 200 and grpc_ok(*two)
    bundle.write_text(certs["ca"].read_text())  # CA 2 removed
    assert r.daemon.reload()
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https(*two)
    assert not grpc_ok(*two)
    assert https(*one) == 200 and grpc_ok(*one)
