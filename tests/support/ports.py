"""A free TCP port on this machine for a test's listener (the kernel picks one; it stays free
long enough for the test to bind it)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
