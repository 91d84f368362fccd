"""/metrics as a scraper reads it: the exposition parsed by prometheus_client's own parsers
(Prometheus text and OpenMetrics) after real requests over HTTP, on the metrics port and on the
HTTP API's port, and the token check on both."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from edgespec.server.auth import hash_token
from edgespec.server.metrics import Metrics
from edgespec.types import GenerationResult, SpecStats
from tests.server.test_daemon import req
from tests.server.test_http import MODEL, raw

HTTP = {"enabled": True, "port": 0}
METRICS = {"enabled": True, "port": 0}


def scrape(port: int, headers: dict | None = None) -> tuple[int, dict, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics", headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode()
    conn.close()
    return out


def samples(text: str, parse=text_string_to_metric_families) -> dict[str, dict]:
    """{family name: {"type": ..., (sample name, sorted label items): value}}"""
    out: dict[str, dict] = {}
    for fam in parse(text):
        d = out.setdefault(fam.name, {"type": fam.type})
        for s in fam.samples:
            d[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


M = ("model", "SmolLM2-135M-Instruct.F32")  # the generation figures' label: the chat model's name


def test_the_scrape_parses_after_real_requests_on_both_ports(make_daemon):
    r = make_daemon(http=HTTP, metrics=METRICS)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{r.daemon.http_port}/v1", api_key="none", max_retries=0, timeout=30)
    model = c.models.list().data[0].id
    c.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0)
    c.completions.create(model=model, prompt="Hello again", max_tokens=3, temperature=0)

    status, headers, text = scrape(r.daemon.metrics_port)
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = samples(text)
    assert fams["edgespec_requests"]["type"] == "counter"
    assert fams["edgespec_requests"][("edgespec_requests_total", (("finish_reason", "length"), M))] == 2
    assert fams["edgespec_generated_tokens"][("edgespec_generated_tokens_total", (M,))] == 8
    assert fams["edgespec_submitted_requests"][("edgespec_submitted_requests_total", (M,))] == 2
    ttft = fams["edgespec_time_to_first_token_seconds"]
    assert ttft["type"] == "histogram"
    buckets = [v for (name, labels), v in ((k, v) for k, v in ttft.items() if k != "type")
               if name.endswith("_bucket")]
    assert buckets == sorted(buckets)  # cumulative
    assert ttft[("edgespec_time_to_first_token_seconds_bucket", (("le", "+Inf"), M))] == 2
    assert ttft[("edgespec_time_to_first_token_seconds_count", (M,))] == 2
    assert ttft[("edgespec_time_to_first_token_seconds_sum", (M,))] > 0
    assert fams["edgespec_ready"] == {"type": "gauge", ("edgespec_ready", ()): 1.0}
    assert fams["edgespec_queue_depth"][("edgespec_queue_depth", ())] == 0
    assert fams["edgespec_cost_host_factor"]["type"] == "gauge"

    # the HTTP API's /metrics serves the same registry; OpenMetrics when the scraper asks for it
    status, headers, om = scrape(r.daemon.http_port, {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["content-type"].startswith("application/openmetrics-text")
    assert om.endswith("# EOF\n")
    fams = samples(om, openmetrics_families)
    assert fams["edgespec_requests"][("edgespec_requests_total", (("finish_reason", "length"), M))] == 2
    assert fams["edgespec_ready"][("edgespec_ready", ())] == 1


def test_label_values_are_escaped_so_that_they_parse_back():
    """A caller's identity is a client certificate's subject: quotes, backslashes and newlines in
    it come back exactly."""
    m = Metrics()
    who = 'cert:CN=a "quoted" \\ name\nO=x'
    m.callers = lambda: {who: {"requests": 2, "rejected": 1, "tokens": 7, "running": 1, "queued": 0, "in_flight": 1,
                               "rejected_by_reason": {"queued": 1}}}
    m.on_finish(GenerationResult("hi", [1, 2, 3], "length", 4, SpecStats()), 0.02, 0.05)
    fams = samples(m.render())
    assert fams["edgespec_caller_requests"][("edgespec_caller_requests_total", (("caller", who),))] == 2
    assert fams["edgespec_caller_in_flight"][("edgespec_caller_in_flight", (("caller", who),))] == 1
    assert fams["edgespec_caller_rejected"][("edgespec_caller_rejected_total", (("caller", who), ("reason", "queued")))] == 1
    fams = samples(m.exposition("application/openmetrics-text")[0].decode(), openmetrics_families)
    assert fams["edgespec_caller_tokens"][("edgespec_caller_tokens_total", (("caller", who),))] == 7


def test_two_daemons_keep_their_own_counts():
    a, b = Metrics(), Metrics()
    a.submitted.inc(3)
    assert a.totals()["requests_total"] == 3 and b.totals()["requests_total"] == 0
    assert 'edgespec_submitted_requests_total{model=""} 3.0' in a.render()
    assert "edgespec_submitted_requests_total{" not in b.render()  # no sample: nothing counted there


@pytest.fixture
def user_token(tmp_path):
    user = tmp_path / "tokens"
    user.write_text(hash_token("user-secret") + "\n")
    return {"tokens_file": str(user)}


def test_metrics_take_a_metrics_or_admin_token_and_per_caller_figures_need_admin(make_daemon, user_token, tmp_path):
    """A scrape token (auth.metrics_tokens_file) reads /metrics without the per-caller families,
    on both ports, and calls nothing else; an admin token reads them all; a user token, none."""
    (tmp_path / "admin").write_text(hash_token("admin-secret") + "\n")
    (tmp_path / "scrape").write_text(f"prometheus:{hash_token('scrape-secret')}\n")
    r = make_daemon(auth={**user_token, "admin_tokens_file": str(tmp_path / "admin"),
                          "metrics_tokens_file": str(tmp_path / "scrape")}, http=HTTP, metrics=METRICS,
                    limits={"caller_concurrent": 4})
    r.inference.Generate(req(max_tokens=2), timeout=5, metadata=(("authorization", "Bearer user-secret"),))
    for port in (r.daemon.metrics_port, r.daemon.http_port):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "user-secret"},
                        {"Authorization": "Bearer user-secret"}):
            status, got, text = scrape(port, headers)
            assert status == 401 and "edgespec_" not in text, (port, headers)
            assert got["www-authenticate"].startswith("Bearer")
        status, _, text = scrape(port, {"Authorization": "Bearer scrape-secret"})
        assert status == 200 and samples(text)["edgespec_ready"][("edgespec_ready", ())] == 1
        assert "edgespec_caller_" not in text and "edgespec_requests_total" in text
        status, _, text = scrape(port, {"Authorization": "Bearer admin-secret"})
        assert status == 200 and 'edgespec_caller_tokens_total{caller="other"}' in text
    scraper = (("authorization", "Bearer scrape-secret"),)
    with pytest.raises(grpc.RpcError) as e:  # a sniffed scrape token grants no inference
        r.inference.Generate(req(max_tokens=2), timeout=5, metadata=scraper)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert raw(r, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
               headers={"Authorization": "Bearer scrape-secret"})[0] == 401
    with pytest.raises(urllib.error.HTTPError) as e:  # and an unknown path is not the exporter
        urllib.request.urlopen(f"http://127.0.0.1:{r.daemon.metrics_port}/other", timeout=5)
    assert e.value.code == 404


def test_the_process_own_figures_are_exported():
    """Resident memory and CPU time of the daemon's process, as prometheus-client collects them."""
    fams = samples(Metrics().render())
    assert fams["process_resident_memory_bytes"][("process_resident_memory_bytes", ())] > 10 << 20
    assert fams["process_cpu_seconds"][("process_cpu_seconds_total", ())] > 0
    assert ("python_info" in fams) and fams["python_gc_collections"]["type"] == "counter"


def test_the_drafter_choice_is_exported_when_a_head_drafts_beside_the_draft():
    """tick_totals' drafter figures (Engine.open_session with two drafters) become a counter of
    requests and a gauge of the last estimates, by drafter; the head's cost host factor joins the
    others'. Without a head none of them appears."""
    m = Metrics()
    m.state = lambda: {"tick_totals": {"drafter_requests_draft": 3, "drafter_requests_head": 5,
                                       "drafter_estimate_draft": 1.1, "drafter_estimate_head": 1.3,
                                       "cost_head_host_factor": 1.2}}
    fams = samples(m.render())
    req = fams["edgespec_drafter_requests"]
    assert req[("edgespec_drafter_requests_total", (("drafter", "head"),))] == 5
    assert req[("edgespec_drafter_requests_total", (("drafter", "draft"),))] == 3
    assert fams["edgespec_drafter_estimated_speedup"][("edgespec_drafter_estimated_speedup", (("drafter", "head"),))] == 1.3
    assert fams["edgespec_cost_host_factor"][("edgespec_cost_host_factor", (("model", "head"),))] == 1.2
    m.state = lambda: {"tick_totals": {"cost_draft_host_factor": 1.0}}
    fams = samples(m.render())
    assert not any(k[1] == (("model", "head"),) for k in fams["edgespec_cost_host_factor"] if isinstance(k, tuple))
    assert len(fams.get("edgespec_drafter_requests", {"type": 0})) == 1  # the family, no samples
