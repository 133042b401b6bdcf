"""pytest plugin: a real, private mosquitto broker per test (fixture ``mosquitto``), set up as
torchpassd's broker setup does (dynamic security, no anonymous access, TLS with a CA made for it):
every test talks to a secure broker. Owns starting it on a free loopback port, stopping it by PID,
and restarting it on the same port (for reconnect tests). The broker's own log is kept in the
test's tmp dir for diagnosis. Usable outside pytest too (benchmarks): ``with Mosquitto(workdir) as
broker: ...``. ``Mosquitto(workdir, insecure=True)`` (anonymous, plain MQTT) exists only for the
tests proving that torchpassd and launchpad refuse such a broker."""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pytest

from torchpass_common.config import BrokerConfig
from torchpassd.broker_files import write_broker_files
from torchpassd.broker_tls import make_broker_tls

START_TIMEOUT = 10.0


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Mosquitto:
    """One mosquitto process listening on ``host``:``port`` (no persistence; the dynamic security
    file keeps accounts across restarts). ``tls``: (ca, cert, key) to serve instead of a CA and
    certificate made in ``workdir``."""

    def __init__(self, workdir: Path, port: int | None = None, *, insecure: bool = False,
                 tls: tuple[str, str, str] | None = None, host: str = "127.0.0.1") -> None:
        exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if not os.access(exe, os.X_OK):
            raise RuntimeError("mosquitto is not installed: run `make setup` (contrib/install/install-deps.sh)")
        self.exe = exe
        self.host = host
        self.port = port or _free_port(host)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.conf = self.workdir / "mosquitto.conf"
        self.logfile = self.workdir / "mosquitto.log"
        # log_dest stdout: as root mosquitto drops to user mosquitto and could not open a log file.
        common = "persistence false\nlog_dest stdout\nlog_type all\n"
        self.files = None
        if not insecure and tls is None:
            tls = make_broker_tls(self.workdir / "tls", [host, "localhost"]).as_tuple()
        self.tls_ca = tls[0] if tls else ""
        if not insecure:
            self.files = write_broker_files(self.workdir, port=self.port, host=self.host, tls=tls,
                                            broker_user=getpass.getuser())
            self.conf = self.files.conf
            self.conf.write_text(self.conf.read_text() + common)
        else:
            self.conf.write_text(f"listener {self.port} {self.host}\nallow_anonymous true\n" + common)
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self, keepalive: int = 5) -> BrokerConfig:
        """A BrokerConfig pointing at this broker, as torchpassd (its admin)."""
        if self.files is None:
            return BrokerConfig(host=self.host, port=self.port, keepalive=keepalive, tls_ca=self.tls_ca)
        return BrokerConfig(host=self.host, port=self.port, keepalive=keepalive, tls_ca=self.tls_ca,
                            username="torchpassd", password_file=str(self.files.password_file))

    def section(self, **extra: Any) -> dict[str, Any]:
        """This broker as the ``[broker]`` section of a config (as torchpassd, its admin), for
        ``config.render``; ``extra`` adds or replaces keys."""
        return {k: v for k, v in {**dataclasses.asdict(self.config()), **extra}.items() if v != ""}

    def start(self) -> None:
        """Start the broker and wait until it accepts TCP connections."""
        if self.proc is not None and self.proc.poll() is None:
            return
        with open(self.logfile, "ab") as out:
            self.proc = subprocess.Popen([self.exe, "-c", str(self.conf)], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode} on start; see {self.logfile}:\n"
                                   + self.logfile.read_text()[-2000:])
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on {self.host}:{self.port} within {START_TIMEOUT} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the broker (by PID) and wait for it; SIGKILL if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def restart(self) -> None:
        """Stop and start again on the same port (retained messages are gone: no persistence)."""
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A running private mosquitto; stopped (by PID) after the test."""
    with Mosquitto(tmp_path / "mosquitto") as broker:
        yield broker
