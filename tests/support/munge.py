"""pytest plugin: a private munged per test (fixture ``munged``, its socket path), with its own key,
so tests can make and check real munge credentials without the dev cluster. Stopped by PID."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT = 15.0


@pytest.fixture
def munged() -> Iterator[str]:
    """Path of a running private munged's socket."""
    if not shutil.which("munged"):
        pytest.skip("munge is not installed (apt install munge)")
    # Not under pytest's tmp dir: munged wants every directory above its socket searchable by all.
    base = Path(tempfile.mkdtemp(prefix="tp-munge-"))
    base.chmod(0o755)
    for sub in ("run", "state"):
        (base / sub).mkdir(mode=0o700)
    (base / "run").chmod(0o755)
    key = base / "state" / "munge.key"
    subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True, timeout=30)
    sock = base / "run" / "munge.socket"
    proc = subprocess.Popen(["munged", "-F", f"--key-file={key}", f"--socket={sock}",
                             f"--pid-file={base / 'run' / 'munged.pid'}", f"--log-file={base / 'state' / 'log'}",
                             f"--seed-file={base / 'state' / 'seed'}"],
                            stdout=subprocess.DEVNULL, stderr=open(base / "state" / "stderr", "wb"),  # noqa: SIM115
                            start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("munged did not start: " + (base / "state" / "stderr").read_text()[-2000:])
            time.sleep(0.02)
        yield str(sock)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        shutil.rmtree(base, ignore_errors=True)
