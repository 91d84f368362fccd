"""Fixtures: a real gRPC server on 127.0.0.1 (port 0) around the fake engine."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from edgespec.proto.edgespec.v1 import admin_pb2_grpc, inference_pb2_grpc
from edgespec.server.config import load
from edgespec.server.daemon import Daemon
from tests.fake_engine import FakeEngine


class Running:
    def __init__(self, daemon: Daemon, engine: Callable[[], FakeEngine]):
        self.daemon = daemon
        self._engine = engine
        self.addr = f"127.0.0.1:{daemon.port}"
        self.channel = grpc.insecure_channel(self.addr)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    @property
    def engine(self) -> FakeEngine:
        return self._engine()


@pytest.fixture
def make_daemon() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def make(*, step_seconds: float = 0.005, load_seconds: float = 0.0, n_ctx: int = 8192, wait: bool = True,
             **sections: dict) -> Running:
        server = {"port": 0, "parallel": 2, "queue_size": 2, "grace_seconds": 2.0, **sections.pop("server", {})}
        cfg = load(None, env={}, overrides={"server": server, **sections})
        holder: list[FakeEngine] = []

        def factory() -> FakeEngine:
            holder.append(FakeEngine(parallel=cfg.server.parallel, n_ctx=n_ctx, step_seconds=step_seconds,
                                     load_seconds=load_seconds))
            return holder[0]

        d = Daemon(cfg, engine_factory=factory)
        d.start()
        if wait:
            assert d.loop.wait_loaded(10)
        r = Running(d, lambda: holder[0])
        started.append(r)
        return r

    yield make
    for r in started:
        r.channel.close()
        r.daemon.shutdown(grace=0.5)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate (openssl CLI)."""
    d = tmp_path_factory.mktemp("certs")

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    try:
        ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=edgespec test CA")
    except FileNotFoundError:
        pytest.skip("openssl not installed")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={'localhost' if name == 'server' else 'edgespec client'}")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")
    # a second, unrelated CA: clients it signs must be refused under mTLS
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.pem",
         "-days", "2", "-subj", "/CN=other")
    # a client whose common name is literally a subject ("ops,O=site"), signed by the CA
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "trick.key", "-out", "trick.csr",
         "-subj", "/CN=ops\\,O=site")
    ossl("x509", "-req", "-in", "trick.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "trick.pem", "-days", "2")
    # a second CA of the site's and a client it signs (a CA removed from client_ca is revoked)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca2.key", "-out", "ca2.pem",
         "-days", "2", "-subj", "/CN=edgespec test CA 2")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client2.key", "-out", "client2.csr",
         "-subj", "/CN=client of CA 2")
    ossl("x509", "-req", "-in", "client2.csr", "-CA", "ca2.pem", "-CAkey", "ca2.key", "-CAcreateserial",
         "-out", "client2.pem", "-days", "2")
    return {
        "trick_cert": d / "trick.pem", "trick_key": d / "trick.key", "ca2": d / "ca2.pem",
        "client2_cert": d / "client2.pem", "client2_key": d / "client2.key",
        "ca": d / "ca.pem", "server_cert": d / "server.pem", "server_key": d / "server.key",
        "client_cert": d / "client.pem", "client_key": d / "client.key", "other_cert": d / "other.pem",
        "other_key": d / "other.key"}
