"""launchpad's save and start_joiner commands take wormhole ends only: a destination or source
carrying a filesystem path (alone or next to host/port/token, in ``saves`` too) is a ProtocolError
saying commands never carry paths, raised before any worker is asked or started."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from launchpad.commands import Commands
from torchpass_common.errors import ProtocolError, WorkerError

DEST = {"host": "127.0.0.1", "port": 7001, "token": "ab" * 32}
SOURCE = {"host": "127.0.0.1", "port": 7002, "token": "cd" * 32}


def commands() -> Commands:
    """Commands of a node that has no workers: any command that got past its checks would fail there."""
    cmds = Commands.__new__(Commands)  # the handlers only need their agent
    cmds.agent, cmds.joiners = SimpleNamespace(node="n1", world_size=2, group=None), {}
    return cmds


def run(handler: Any, args: dict[str, Any]) -> None:
    asyncio.run(handler(args, 2, "m1"))


@pytest.mark.security
@pytest.mark.parametrize("args", [
    {"rank": 1, "dest": {"path": "/tmp/rank1.state"}},
    {"rank": 1, "dest": {**DEST, "path": "/tmp/rank1.state"}},
    {"saves": [{"rank": 0, "dest": DEST}, {"rank": 1, "dest": {"path": "/tmp/rank1.state"}}]},
], ids=["path", "path-beside-wormhole", "one-of-saves"])
def test_a_save_to_a_file_path_is_refused(args):
    with pytest.raises(ProtocolError, match=r"carries a filesystem path .*commands never carry filesystem paths"):
        run(commands().save, args)


@pytest.mark.security
@pytest.mark.parametrize("source", [{"path": "/tmp/rank1.state"}, {**SOURCE, "path": "/tmp/rank1.state"}],
                         ids=["path", "path-beside-wormhole"])
def test_a_joiner_reading_a_file_path_is_refused(source):
    with pytest.raises(ProtocolError, match="start_joiner's 'source' is refused: it carries a filesystem path"):
        run(commands().start_joiner, {"rank": 1, "source": source})


def test_wormhole_ends_pass_the_check_and_incomplete_ones_are_named():
    with pytest.raises(WorkerError, match="no workers are running"):  # past the check: no workers here
        run(commands().save, {"rank": 1, "dest": DEST})
    with pytest.raises(WorkerError, match="no worker group"):
        run(commands().start_joiner, {"rank": 1, "source": SOURCE})
    with pytest.raises(ProtocolError, match=r"must be a wormhole end \{host, port, token\}, got \['host'\]"):
        run(commands().save, {"rank": 1, "dest": {"host": "127.0.0.1"}})
    with pytest.raises(ProtocolError, match=r"start_joiner's 'source' is refused: its port must be 1-65535"):
        run(commands().start_joiner, {"rank": 1, "source": {**SOURCE, "port": 0}})


@pytest.mark.security
def test_a_list_of_joiners_is_refused_whole_when_one_source_carries_a_path():
    joiners = [{"rank": 1, "source": SOURCE}, {"rank": 3, "source": {**SOURCE, "path": "/tmp/rank3.state"}}]
    with pytest.raises(ProtocolError, match="start_joiner's 'source' is refused: it carries a filesystem path"):
        run(commands().start_joiner, {"joiners": joiners})
    with pytest.raises(ProtocolError, match="'joiners' must be a non-empty list"):
        run(commands().start_joiner, {"joiners": []})
