"""systemd's notification protocol (sd_notify) in pure stdlib: no libsystemd, no extra dependency.

The daemon tells systemd what it is doing by sending `KEY=VALUE` lines in one datagram to the
AF_UNIX socket named by $NOTIFY_SOCKET (a path, or `@name` for an abstract socket). Without
$NOTIFY_SOCKET (not started by systemd, or Type= is not notify) every call is a no-op.

Lifecycle under `Type=notify`:
    status("loading target ...") + extend_timeout(600)   while loading each model
    ready()                                              after both models are loaded and warmed
    Watchdog.kick()                                      from the engine loop, on real progress
    stopping()                                           when SIGTERM starts the drain
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable

_SOCKET_ENV = "NOTIFY_SOCKET"
_KEY = re.compile(r"[A-Z][A-Z0-9_]*")


def _address(raw: str) -> str | bytes | None:
    if raw.startswith("@"):  # abstract namespace: leading NUL byte instead of '@'
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock (`vsock:CID:PORT`) and other forms are not used by this appliance


def _format(fields: dict[str, object]) -> bytes:
    lines = []
    for key, value in fields.items():
        if not _KEY.fullmatch(key):
            raise ValueError(f"bad sd_notify key {key!r}")
        text = str(int(value)) if isinstance(value, bool) else str(value)
        if "\n" in text:  # one field per line: a newline would smuggle in another field
            raise ValueError(f"sd_notify value for {key} must be one line")
        lines.append(f"{key}={text}")
    return ("\n".join(lines) + "\n").encode()


def notify(**fields: object) -> bool:
    """Send one datagram with `KEY=VALUE` per field; True if sent, False if there is no socket.

    e.g. notify(READY=1, STATUS="serving"). Failures to send are reported as False, never raised:
    a daemon must not die because its supervisor went away.
    """
    raw = os.environ.get(_SOCKET_ENV, "")
    address = _address(raw) if raw else None
    if address is None or not fields:
        return False
    payload = _format(fields)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload)
    except OSError:
        return False
    return True


def enabled() -> bool:
    """True when started by systemd with a notification socket."""
    return bool(os.environ.get(_SOCKET_ENV))


def ready(status_text: str | None = None) -> bool:
    """READY=1: the service is up (both models loaded and warmed). systemd starts dependants now."""
    return notify(READY=1, **({"STATUS": status_text} if status_text else {}))


def status(text: str) -> bool:
    """STATUS=: a one-line, human-readable state shown by `systemctl status`."""
    return notify(STATUS=text)


def extend_timeout(seconds: float) -> bool:
    """EXTEND_TIMEOUT_USEC=: ask for `seconds` more before TimeoutStartSec/StopSec fires.

    Send it again before it runs out while a large model is still loading.
    """
    return notify(EXTEND_TIMEOUT_USEC=max(1, int(seconds * 1_000_000)))


def watchdog() -> bool:
    """WATCHDOG=1: one keep-alive. Prefer `Watchdog.kick()`, which rate-limits."""
    return notify(WATCHDOG=1)


def stopping(status_text: str | None = "draining") -> bool:
    """STOPPING=1: the service is shutting down (drain started)."""
    return notify(STOPPING=1, **({"STATUS": status_text} if status_text else {}))


def watchdog_interval() -> float | None:
    """Seconds between keep-alives systemd expects (WatchdogSec=), or None when no watchdog.

    From $WATCHDOG_USEC; when $WATCHDOG_PID is set and is not this process, the watchdog is
    meant for someone else (e.g. a parent shell) and this returns None.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 if value > 0 else None


class Watchdog:
    """Keep-alives driven by real progress, not by a timer.

    The engine thread calls `kick()` after every target forward and after every idle wait on its
    request queue (waiting at most `poll_timeout` seconds). A wedged llama_decode, a deadlock or a
    stuck GPU therefore stops the kicks, and systemd restarts the service after WatchdogSec=.
    WATCHDOG=1 goes out at most once per interval/2, and only from `kick()`.
    """

    def __init__(
        self,
        interval: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        send: Callable[[], bool] = watchdog,
    ):
        self.interval = watchdog_interval() if interval is None else interval
        self._clock = clock
        self._send = send
        self._last: float | None = None
        self.sent = 0  # keep-alives actually sent

    @property
    def active(self) -> bool:
        return self.interval is not None and self.interval > 0

    @property
    def poll_timeout(self) -> float:
        """Longest an idle engine loop may block before it must come round and kick again."""
        return self.interval / 4 if self.interval is not None and self.interval > 0 else 1.0

    def kick(self) -> bool:
        """Record progress; send WATCHDOG=1 if half an interval passed since the last one."""
        if self.interval is None or self.interval <= 0:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.interval / 2:
            return False
        self._last = now
        if self._send():
            self.sent += 1
            return True
        return False
