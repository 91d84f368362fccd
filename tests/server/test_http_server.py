"""edgespec.server.http_server: under mutual TLS the verified client certificate reaches the
routes as the ASGI TLS extension and is the caller's identity (real HTTPS on loopback), and
PeerCertificates forgets a connection's certificate when it closes."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl

from prometheus_client.parser import text_string_to_metric_families

from edgespec.server.auth import hash_token
from edgespec.server.http_server import PeerCertificates

HTTP = {"enabled": True, "port": 0}
CLIENT = "cert:CN=edgespec client"


def test_the_client_certificate_is_the_identity_where_tokens_are_required(make_daemon, certs, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(hash_token("user-secret") + "\n")
    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"]), "client_ca": str(certs["ca"])}
    # an admin certificate: /metrics with the per-caller figures
    r = make_daemon(http=HTTP, tls=tls, auth={"tokens_file": str(tokens), "admin_subjects": [CLIENT.removeprefix("cert:")]},
                    metrics={"enabled": True, "port": 0},
                    limits={"callers": [f"{CLIENT}=4/0"]})
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    ctx.load_cert_chain(str(certs["client_cert"]), str(certs["client_key"]))
    conn = http.client.HTTPSConnection("localhost", r.daemon.http_port, context=ctx, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 2}),
                 headers={"Content-Type": "application/json"})  # no bearer token: the certificate is enough
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.read()
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.status == 200
    fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    conn.close()
    got = {s.labels["caller"]: s.value for s in fams["edgespec_caller_requests"].samples}
    assert got.get(CLIENT) == 1  # counted under the certificate's subject, as gRPC writes it


class FakeTransport(asyncio.BaseTransport):
    def __init__(self, peer: tuple, peercert: dict | None):
        super().__init__()
        self.extra = {"peername": peer, "peercert": peercert, "ssl_object": FakeSSL() if peercert else None}

    def get_extra_info(self, name, default=None):
        return self.extra.get(name, default)


class FakeSSL:
    def getpeercert(self, binary_form: bool = False):
        return b""

    def version(self):
        return "TLSv1.3"


class Inner(asyncio.Protocol):
    def __init__(self, *args, **kwargs):
        self.args, self.made, self.lost = args, False, False

    def connection_made(self, transport):
        self.made = True

    def connection_lost(self, exc):
        self.lost = True


def test_a_connections_certificate_is_handed_to_its_requests_and_forgotten_when_it_closes():
    peers = PeerCertificates()
    seen: list[dict | None] = []

    async def app(scope, receive, send):
        seen.append(scope.get("extensions", {}).get("tls"))

    wrapped = peers.app(app)
    cert = {"subject": ((("organizationName", "site"),), (("commonName", "ops"),))}
    proto = peers.protocol(Inner)("config", "state")
    assert proto.inner.args == ("config", "state")  # uvicorn's arguments reach its protocol
    proto.connection_made(FakeTransport(("::1", 4242, 0, 0), cert))
    assert proto.inner.made
    plain = peers.protocol(Inner)()
    plain.connection_made(FakeTransport(("127.0.0.1", 5000), None))

    def request(client):
        asyncio.run(wrapped({"type": "http", "client": client}, None, None))
        return seen[-1]

    tls = request(["::1", 4242])
    assert tls["client_subject"] == ("CN=ops,O=site", "ops") and tls["client_cert_name"] == "CN=ops,O=site"
    assert tls["tls_version"] == 0x0304
    assert request(("127.0.0.1", 5000)) is None  # no certificate, no extension
    proto.connection_lost(None)
    assert proto.inner.lost
    assert request(("::1", 4242)) is None  # the closed connection's certificate is gone
