"""torchpassd's control socket with its real client over a real Unix socket: requests and
refusals, a daemon that is not running or already running, and file-permission access control
checked from an unprivileged process (user nobody, forked)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from torchpass_common.errors import ConfigError, MigrationError
from torchpassd.control_socket import ControlServer, ControlSocketError
from torchpassd.ctl_client import DaemonClient
from torchpassd.journal import PhaseRecord

pytestmark = pytest.mark.timeout(60)


async def _status(args: dict[str, Any]) -> Any:
    return {"jobs": 2, "echo": args}


async def _phases(args: dict[str, Any]) -> Any:
    return [PhaseRecord("paused", "running", {"step": 4}, 1.0, 0.5)]


async def _refuse(args: dict[str, Any]) -> Any:
    raise MigrationError("no free spare", job="7", hint="add a node to torchpass_spares")


async def _boom(args: dict[str, Any]) -> Any:
    raise RuntimeError("bug")


HANDLERS = {"status": _status, "phases": _phases, "refuse": _refuse, "boom": _boom}


def serve(path: Path, client_side: Any, *, group: str = "") -> Any:
    """Run a ControlServer at ``path`` while ``client_side()`` runs in a thread; return its result."""
    async def main() -> Any:
        async with ControlServer(path, HANDLERS, group=group):
            return await asyncio.wait_for(asyncio.to_thread(client_side), 30)
    return asyncio.run(main())


def test_requests_results_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "run" / "torchpassd.sock"

    def client() -> list[Any]:
        c = DaemonClient(path, timeout=10)
        out: list[Any] = [c.call("status", job="9"), c.call("phases")]
        for op in ("refuse", "boom", "nope"):
            with pytest.raises(ControlSocketError) as err:
                c.call(op)
            out.append(str(err.value))
        out.append(c.call("status"))  # still serving after a handler bug
        return out

    status, phases, refused, boom, unknown, again = serve(path, client)
    assert status == {"jobs": 2, "echo": {"job": "9"}}
    assert phases == [{"phase": "paused", "status": "running", "detail": {"step": 4}, "at": 1.0, "seconds": 0.5}]
    assert refused == "torchpassd refused refuse: no free spare (job=7) - add a node to torchpass_spares"
    assert "internal error in torchpassd: RuntimeError: bug" in boom
    assert "unknown op 'nope'" in unknown and "known ops: boom, phases, refuse, status" in unknown
    assert again["jobs"] == 2
    assert not path.exists(), "the socket is removed when the server stops"


def test_client_says_clearly_when_the_daemon_is_not_running(tmp_path: Path) -> None:
    path = tmp_path / "torchpassd.sock"
    with pytest.raises(ControlSocketError, match="torchpassd is not running: no control socket at"):
        DaemonClient(path).call("status")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # bound, never listening: what a killed daemon leaves behind
    stale.close()
    with pytest.raises(ControlSocketError, match="is a stale socket") as err:
        DaemonClient(path).call("status")
    assert "systemctl start torchpassd" in str(err.value)
    # A new daemon replaces the stale socket instead of failing.
    assert serve(path, lambda: DaemonClient(path).call("status"))["jobs"] == 2


def test_a_second_daemon_on_the_same_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "torchpassd.sock"

    async def main() -> None:
        async with ControlServer(path, HANDLERS):
            with pytest.raises(ControlSocketError, match="another torchpassd is already listening"):
                async with ControlServer(path, HANDLERS):
                    pass
    asyncio.run(main())


def test_unknown_control_group_is_a_config_error(tmp_path: Path) -> None:
    async def main() -> None:
        async with ControlServer(tmp_path / "s.sock", HANDLERS, group="no-such-group-tp"):
            pass
    with pytest.raises(ConfigError, match="control_group 'no-such-group-tp' does not exist"):
        asyncio.run(main())


# ---------------------------------------------------------------- access control

def as_nobody(path: Path) -> tuple[int, str]:
    """Call ``status`` from a forked child running as nobody:nogroup; (exit code, output).
    Forked rather than exec'd: the venv's interpreter lives under /root, which nobody cannot read."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop privileges, call, report, and never return into pytest
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code, out = 0, repr(DaemonClient(path, timeout=10).call("status"))
        except ControlSocketError as exc:
            code, out = 1, str(exc)
        except BaseException as exc:  # anything else is reported, not raised in a fork
            code, out = 2, f"{type(exc).__name__}: {exc}"
        os.write(write_end, out.encode())
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        output = r.read().decode()  # EOF when the child exits
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory user nobody can traverse (pytest's tmp dirs are root-only)."""
    path = Path(tempfile.mkdtemp(prefix="tpctl-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as user nobody")
def test_only_root_may_use_the_socket_without_a_group(shared_dir: Path) -> None:
    path = shared_dir / "torchpassd.sock"
    mode, (code, output) = serve(path, lambda: (stat.S_IMODE(path.stat().st_mode), as_nobody(path)))
    assert mode == 0o600
    assert code == 1
    assert output == (
        f"permission denied on the control socket {path} - run torchpassctl as root, "
        "or set orchestrator.control_group to grant a group access")


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as user nobody")
def test_members_of_the_control_group_may_use_the_socket(shared_dir: Path) -> None:
    path = shared_dir / "torchpassd.sock"
    st, (code, output) = serve(path, lambda: (path.stat(), as_nobody(path)), group="nogroup")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 0, 65534)
    assert code == 0, output
    assert "'jobs': 2" in output
