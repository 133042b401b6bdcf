"""systemd's notify protocol for torchpassd (Type=notify): READY=1, STATUS=..., STOPPING=1 and
the watchdog, sent as datagrams straight to $NOTIFY_SOCKET (no libsystemd). Outside systemd
there is no socket and every call is a no-op returning False. The watchdog is pinged from the
event loop itself, so a blocked loop stops the pings and systemd restarts the daemon."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

from torchpass_common import log


def notify(*fields: str) -> bool:
    """Send ``KEY=value`` fields in one datagram; False when not run under systemd."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto("\n".join(fields).encode(), address)
        except OSError as exc:
            log.get().warning("sdnotify.failed", socket=address, error=str(exc))
            return False
    return True


def ready(status: str = "") -> bool:
    """Startup is complete (journal loaded, sockets listening)."""
    return notify("READY=1", *([f"STATUS={status}"] if status else []))


def status(text: str) -> bool:
    """One line shown by ``systemctl status torchpassd``."""
    return notify(f"STATUS={text}")


def stopping() -> bool:
    return notify("STOPPING=1")


def watchdog_interval() -> float | None:
    """Seconds between pings systemd expects (half of WatchdogSec), or None if no watchdog
    applies to this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 2


async def watchdog_loop(healthy: Callable[[], bool] = lambda: True) -> None:
    """Ping WATCHDOG=1 every half WatchdogSec while ``healthy()``; returns at once without a
    watchdog. Run it as a task on the daemon's event loop."""
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        if healthy():
            notify("WATCHDOG=1")
        else:
            log.get().warning("sdnotify.watchdog_withheld", reason="health check failed")
        await asyncio.sleep(interval)


async def broker_status_loop(connected: Callable[[], bool], backend: str, interval: float = 1.0) -> None:
    """Keep STATUS= saying whether the MQTT broker is reachable (``connected()``, looked at every
    ``interval`` s): while it is not, the clients reconnect with backoff and no node is declared dead
    from silence (failure_detect holds its decisions)."""
    was: bool | None = None
    while True:
        now = connected()
        if now != was:
            if now:
                text = f"watching Slurm through {backend}; broker connected"
            else:
                text = f"watching Slurm through {backend}; broker unreachable since " \
                       f"{time.strftime('%H:%M:%S')}: reconnecting; no node is declared dead meanwhile"
            status(text)
            if was is not None:
                logger = log.get()
                (logger.info if now else logger.warning)("torchpassd.broker", connected=now)
            was = now
        await asyncio.sleep(interval)
