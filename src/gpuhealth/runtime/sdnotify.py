"""systemd's notify protocol without a dependency: datagrams of ``KEY=value`` lines sent to the
AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace).

``Type=notify`` units wait for ``READY=1``; ``WatchdogSec=`` units must send ``WATCHDOG=1`` more
often than ``$WATCHDOG_USEC`` (we send at half of it). Outside systemd every call is a no-op, and a
failed send is logged once, never raised: telling systemd is never worth stopping the agent.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def _address(path: str) -> str | bytes:
    """``@name`` → abstract socket address (leading NUL), as sd_notify(3) does."""
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


class SystemdNotifier:
    """Sends notify messages. ``env`` defaults to ``os.environ`` (read once, at construction)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.socket_path: str | None = env.get("NOTIFY_SOCKET") or None
        self.watchdog_interval_s: float | None = self._watchdog_interval(env)
        self._sock: socket.socket | None = None
        self._warned = False

    @staticmethod
    def _watchdog_interval(env: Mapping[str, str]) -> float | None:
        usec = env.get("WATCHDOG_USEC")
        if not usec:
            return None
        pid = env.get("WATCHDOG_PID")
        if pid and pid.isdigit() and int(pid) != os.getpid():
            return None  # the watchdog is meant for another process (e.g. our parent)
        try:
            value = int(usec)
        except ValueError:
            return None
        return value / 2 / 1e6 if value > 0 else None

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    def notify(self, **fields: str) -> bool:
        """Send one message; keys are upper-cased (``ready="1"`` → ``READY=1``). True when sent."""
        if self.socket_path is None:
            return False
        payload = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                # Non-blocking: a unix datagram send blocks while the receiver's queue is full, and
                # the watchdog ping comes from the scheduler loop, which must never wait.
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(payload, _address(self.socket_path))
        except BlockingIOError:
            log.debug("systemd notify socket full; dropped %r", payload)
            return False
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify systemd at %s: %s", self.socket_path, exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str = "") -> bool:
        if status:
            return self.notify(ready="1", status=status)
        return self.notify(ready="1")

    def status(self, text: str) -> bool:
        return self.notify(status=text)

    def watchdog(self) -> bool:
        return self.notify(watchdog="1")

    def reloading(self) -> bool:
        return self.notify(reloading="1")

    def stopping(self) -> bool:
        return self.notify(stopping="1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


__all__ = ["SystemdNotifier"]
