"""End to end, the partitions the slots do not show: the prompt store and the suffix cache, through
the real servicers (gRPC and the HTTP API) of `edgespec serve` as a real process on the demo
models, with two identities (alice's and bob's bearer tokens) and one slot, so that each new
caller's request moves the slot's prefill into the prompt store.

Under `prompt_cache_scope = "caller"` and `suffix_cache_scope = "caller"` (the defaults) bob
reuses and counts nothing alice left: a prefix of hers in the store gives him `cached_tokens` 0
and `draft_cached_tokens` 0 while it gives her own next request its reuse, and his request on her
question drafts next to nothing from the suffix cache while her repeat drafts from her reply
(Admin Stats' accepted_by_source["suffix"]). Under the
opt-in "pooled" scopes bob reads her prefix off the store and drafts from her reply, as
docs/appliance.md says. A servicer that dropped the caller (caller="") would pass the pooled
checks and fail the caller ones. Short prompts, a few tokens each. Slow: CI runs it."""

from __future__ import annotations

import subprocess

import pytest

from edgespec.config import models_dir
from edgespec.proto.edgespec.v1 import admin_pb2
from edgespec.server.auth import hash_token
from edgespec.server.config import DEMO_DRAFT, DEMO_TARGET
from tests.server.processes import start_http_daemon, stop
from tests.server.test_tenants_e2e import ADMIN, TOKENS, Server, _grpc, _http

pytestmark = pytest.mark.slow
LOAD_TIMEOUT = 900  # a daemon calibrates its cost model as it starts: minutes on a busy 2-core host


@pytest.fixture(scope="module", params=["caller", "pooled"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if not ((models_dir() / DEMO_TARGET).is_file() and (models_dir() / DEMO_DRAFT).is_file()):
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    d = tmp_path_factory.mktemp(f"caches-{request.param}")
    (d / "tokens").write_text("".join(f"{name}:{hash_token(t)}\n" for name, t in TOKENS.items()))
    (d / "admin_tokens").write_text(f"ops:{hash_token(ADMIN)}\n")
    proc: subprocess.Popen
    proc, addr, base = start_http_daemon(d, {
        "EDGESPEC_SERVER_GRACE_SECONDS": "5", "EDGESPEC_TARGET_N_CTX": "512", "EDGESPEC_DRAFT_N_CTX": "512",
        "EDGESPEC_SERVER_QUEUE_SIZE": "2", "EDGESPEC_AUTH_TOKENS_FILE": str(d / "tokens"),
        "EDGESPEC_AUTH_ADMIN_TOKENS_FILE": str(d / "admin_tokens"),
        "EDGESPEC_SERVER_PROMPT_CACHE_BYTES": str(64 << 20),
        "EDGESPEC_SERVER_PROMPT_CACHE_SCOPE": request.param,
        "EDGESPEC_SPECULATION_SUFFIX_CACHE_SCOPE": request.param}, parallel=1, load_timeout=LOAD_TIMEOUT)
    s = Server(proc, addr, base, 0)
    yield request.param, s
    s.channel.close()
    stop(proc)


def _memo(topic: str) -> str:
    """A confidential prefix of ~150 tokens that starts with its topic (topics share no first token)."""
    return f"{topic}: CONFIDENTIAL. " + " ".join(f"{topic} ledger {i}: branch {i % 7} owes {(13 * i) % 97} units."
                                                   for i in range(10))


def _suffix_accepted(server: Server) -> int:
    """Draft tokens the suffix cache proposed and the target accepted, over every request so far."""
    server.wait_idle()  # the finished request's reply is in the cache
    stats = server.admin.Stats(admin_pb2.StatsRequest(), timeout=30, metadata=server.md("ops"))
    return stats.accepted_by_source["suffix"]


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_the_prompt_store_serves_only_its_callers_unless_pooled(server, api):
    scope, s = server
    send = _grpc if api == "grpc" else _http
    memo = _memo("Walnut" if api == "grpc" else "Zephyr")
    n, cached, _ = send(s, "alice", memo + "\nQ: who owes most?")
    assert n > 120 and cached == 0
    send(s, "alice", _memo("Quartz" if api == "grpc" else "Yarrow") + "\nQ: total?")  # her memo's prefill: to the store
    s.wait_idle()
    _, bob_cached, bob_draft_cached = send(s, "bob", memo + "\nQ: summary?")  # bob takes the slot: alice's goes to the store
    if scope == "caller":
        assert (bob_cached, bob_draft_cached) == (0, 0)
        _, cached, _ = send(s, "alice", memo + "\nQ: summary?")  # hers, from the store (the slot held bob's)
        assert cached > 100
    else:  # pooled, as documented: any caller reuses, and reads off the counter, what another left
        assert bob_cached > 100


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_the_suffix_cache_drafts_for_its_caller_only_unless_pooled(server, api):
    """Alice's reply drafts her own repeat of the question; bob's same question drafts from it only
    when pooled. (A caller's own earlier replies may still draft a few tokens of his: shared
    line patterns, "\n2." say; what bob must not get is hers, the whole answer.)"""
    scope, s = server
    send = _grpc if api == "grpc" else _http
    # two answers of different shapes: a caller's own earlier reply drafts a little of his next one
    # where they share a pattern ("\n2." of two numbered lists), which is his, not a leak
    question = ("List the days of the week, in order, one per line." if api == "grpc"
                else "Name the months of the year in order, separated by commas.")
    send(s, "alice", question, max_tokens=24)
    start = _suffix_accepted(s)
    send(s, "bob", question, max_tokens=24)  # the same question: alice's reply would draft his
    bob = _suffix_accepted(s) - start
    send(s, "alice", question, max_tokens=24)
    alice = _suffix_accepted(s) - start - bob
    assert alice >= 8, (alice, bob)  # her reply drafts her repeat: the counter works
    if scope == "caller":
        assert 3 * bob <= alice, (alice, bob)
    else:
        assert 2 * bob >= alice, (alice, bob)
