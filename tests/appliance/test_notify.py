"""sd_notify against a real AF_UNIX datagram socket the test creates (path and abstract)."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from edgespec import notify


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def _recv(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    assert data.endswith("\n")
    return dict(line.split("=", 1) for line in data.splitlines())


def test_noop_without_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify.enabled()
    assert notify.ready() is False
    assert notify.status("x") is False


def test_ready_status_extend_stopping(notify_socket):
    assert notify.enabled()
    assert notify.status("loading target model")
    assert _recv(notify_socket) == {"STATUS": "loading target model"}
    assert notify.extend_timeout(90)
    assert _recv(notify_socket) == {"EXTEND_TIMEOUT_USEC": "90000000"}
    assert notify.ready("serving on 127.0.0.1:50051")
    assert _recv(notify_socket) == {"READY": "1", "STATUS": "serving on 127.0.0.1:50051"}
    assert notify.watchdog()
    assert _recv(notify_socket) == {"WATCHDOG": "1"}
    assert notify.stopping()
    assert _recv(notify_socket) == {"STOPPING": "1", "STATUS": "draining"}


def test_one_datagram_per_call(notify_socket):
    notify.notify(READY=True, STATUS="a b=c", MAINPID=os.getpid())
    assert _recv(notify_socket) == {"READY": "1", "STATUS": "a b=c", "MAINPID": str(os.getpid())}


def test_rejects_injection_and_bad_keys(notify_socket):
    with pytest.raises(ValueError):
        notify.notify(STATUS="line\nREADY=1")
    with pytest.raises(ValueError):
        notify.notify(status="lowercase")


def test_abstract_socket(monkeypatch):
    name = f"edgespec-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    try:
        assert notify.ready()
        assert _recv(sock) == {"READY": "1"}
    finally:
        sock.close()


def test_send_failure_is_false_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert notify.ready() is False


def test_watchdog_interval_from_env(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert notify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 30.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert notify.watchdog_interval() is None


def test_watchdog_sends_only_when_kicked_and_at_most_every_half_interval():
    now = [0.0]
    sent = []
    dog = notify.Watchdog(10.0, clock=lambda: now[0], send=lambda: sent.append(now[0]) or True)
    assert dog.active and dog.poll_timeout == 2.5
    assert dog.kick()  # first progress: sent at once
    now[0] = 4.9
    assert not dog.kick()  # < interval/2 since the last one
    now[0] = 5.0
    assert dog.kick()
    now[0] = 60.0  # no kicks for a long time (engine wedged): nothing was sent meanwhile
    assert sent == [0.0, 5.0]
    assert dog.kick() and dog.sent == 3


def test_watchdog_inactive_without_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    dog = notify.Watchdog(send=lambda: pytest.fail("must not send"))
    assert not dog.active and not dog.kick()


def test_watchdog_kick_reaches_socket(notify_socket):
    dog = notify.Watchdog(2.0)
    assert dog.kick()
    assert _recv(notify_socket) == {"WATCHDOG": "1"}
