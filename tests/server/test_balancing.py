"""Several appliances behind one client channel: gRPC's round_robin with client-side health
checking and a retry policy for UNAVAILABLE (edgespec.server.channel.SERVICE_CONFIG). Three real
daemon processes on loopback around the fake engine; one drains and one is killed (SIGKILL) in
the middle of 300 requests: none is lost, none reaches the draining replica once the client has
seen it NOT_SERVING (counted from each replica's own access log)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.errors import BadRequest
from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from edgespec.server.channel import ClientOptions, open_channel, resolve_target
from tests.server.processes import stop
from tests.server.test_daemon import req

ROOT = Path(__file__).resolve().parents[2]
N_REQUESTS, N_WORKERS = 300, 4
START_TIMEOUT = 120


class Replica:
    def __init__(self, tmp: Path, name: str):
        self.name, self.log = name, tmp / f"{name}.log"
        self._err = open(self.log, "w")  # closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.server.fake_daemon", "0.002"], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True)
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT)
        if not (box and box[0].startswith("SERVING ")):
            self.stop()
            pytest.fail(f"{name} did not start: {box}\n{self.log.read_text()[-2000:]}")
        self.addr = box[0].split()[1]

    def rpc_lines(self) -> list[tuple[str, str]]:
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                e = json.loads(line)
                if e.get("event") == "rpc":
                    out.append((e["method"].rsplit("/", 1)[1], e["code"]))
        return out

    def stop(self) -> None:
        stop(self.proc, 30)
        self._err.close()


@pytest.fixture
def replicas(tmp_path):
    started: list[Replica] = []
    try:
        for name in ("a", "b", "c"):
            started.append(Replica(tmp_path, name))
        yield started
    finally:
        for r in started:
            r.stop()


def test_targets():
    assert resolve_target("127.0.0.1:50051") == ("127.0.0.1:50051", False)
    assert resolve_target("127.0.0.1:1, 127.0.0.2:2") == ("ipv4:127.0.0.1:1,127.0.0.2:2", True)
    assert resolve_target("[::1]:1,[::1]:2") == ("ipv6:[::1]:1,[::1]:2", True)
    assert resolve_target("dns:///edgespec.site:50051") == ("dns:///edgespec.site:50051", True)
    assert resolve_target("localhost:1,127.0.0.1:2")[0].startswith("ipv4:127.0.0.1:1,")
    with pytest.raises(BadRequest, match="--addr: expected host:port"):
        resolve_target("127.0.0.1:1,nope")


def test_one_drains_one_is_killed_none_lost(replicas):
    a, b, c = replicas
    channel = open_channel(ClientOptions(addr=",".join(r.addr for r in replicas)))
    stub = inference_pb2_grpc.InferenceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    grpc.channel_ready_future(channel).result(timeout=60)

    results: list[str] = []
    cond = threading.Condition()
    gate = threading.Event()
    gate.set()
    in_flight = 0
    todo = iter(range(N_REQUESTS))

    def worker() -> None:
        nonlocal in_flight
        while True:
            gate.wait()
            with cond:
                if next(todo, None) is None:
                    return
                in_flight += 1
            try:
                stub.Generate(req(max_tokens=4), timeout=60)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = exc.code().name
            with cond:
                in_flight -= 1
                results.append(outcome)
                cond.notify_all()

    def wait_done(n: int) -> None:
        with cond:
            assert cond.wait_for(lambda: len(results) >= n, timeout=300), results[-5:]

    threads = [threading.Thread(target=worker) for _ in range(N_WORKERS)]
    for t in threads:
        t.start()
    try:
        wait_done(100)
        gate.clear()  # hold new requests while b drains, so none is in flight on it when it does
        with cond:
            assert cond.wait_for(lambda: in_flight == 0, timeout=120)
        with grpc.insecure_channel(b.addr) as ch:
            assert admin_pb2_grpc.AdminStub(ch).Drain(admin_pb2.DrainRequest(), timeout=10).draining
        # The client has seen b NOT_SERVING once round robin skips it: health checks through the
        # balanced channel, until a full cycle of them met only SERVING replicas.
        streak = 0
        for _ in range(1000):
            st = health.Check(health_pb2.HealthCheckRequest(service="edgespec.v1.Inference"), timeout=10).status
            streak = streak + 1 if st == health_pb2.HealthCheckResponse.SERVING else 0
            if streak >= 6:
                break
        assert streak >= 6, "the balanced channel kept picking the draining replica"
        gate.set()
        wait_done(200)
        c.proc.send_signal(signal.SIGKILL)  # mid-run, requests in flight on it
        c.proc.wait(30)
        for t in threads:
            t.join(300)
    finally:
        gate.set()
        channel.close()

    assert len(results) == N_REQUESTS
    lost = [r for r in results if r not in ("OK", "UNAVAILABLE")]
    assert lost == [], lost  # every request answered, or reported UNAVAILABLE
    per = {r.name: r.rpc_lines() for r in replicas}
    drain_at = per["b"].index(("Drain", "OK"))
    after_drain = [m for m, _ in per["b"][drain_at + 1:] if m == "Generate"]
    served = {name: sum(1 for m, code in lines if m == "Generate" and code == "OK") for name, lines in per.items()}
    print(f"per replica: served {served}, b before drain {sum(1 for m, _ in per['b'][:drain_at] if m == 'Generate')}, "
          f"b after drain {len(after_drain)}, client OK {results.count('OK')}, UNAVAILABLE {results.count('UNAVAILABLE')}")
    assert after_drain == []  # nothing routed to the NOT_SERVING replica
    assert all(served[n] > 0 for n in "abc")  # all three took traffic before drain / kill
    assert served["a"] > served["b"] and served["a"] > served["c"]  # a alone served the end of the run
    assert results.count("OK") >= N_REQUESTS - 2 * N_WORKERS  # a failure is the exception, not the rule
