"""Active abort on real gloo, one process per rank: a rank frozen in the middle of training (it
stops taking part in collectives) leaves the others waiting in an all-reduce until the group's
timeout; TorchPassGroup.sever, called from another thread as the worker's reader thread calls
it, frees each of them at once, in the default group and in a subgroup, reports why through
failed(), and leaves the store usable so the next generation forms without the frozen rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.ports import free_port
from torchpass import severing

RANK_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torchpass.group import TorchPassGroup

    rank, world, port, where = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    pg = TorchPassGroup("gloo", dist.PrefixStore("gen1/", store), rank, world, timedelta(seconds=60), local=False)
    sub = pg.new_group([1, world - 1], group_name="with_the_frozen_rank")  # None outside it
    pg.allreduce([torch.ones(8)]).wait()  # every rank took part once
    if rank == world - 1:  # frozen: alive, connected, never answers again
        time.sleep(120)
        sys.exit(0)
    out = {"rank": rank}
    def sever():
        time.sleep(1.0)
        out["cut"] = pg.sever("n4 was lost (test)")
    cutter = threading.Thread(target=sever, daemon=True)
    cutter.start()
    if rank == 0:  # rank 0 is severed while it computes, the others while they wait
        time.sleep(2.0)
    t0 = time.monotonic()
    try:
        group = sub if where == "sub" and sub is not None else pg
        group.allreduce([torch.ones(8)]).wait()
        out["completed"] = True
    except RuntimeError as exc:
        out["error"] = str(exc)[:200]
    out["waited_s"] = round(time.monotonic() - t0, 2)
    cutter.join()
    out["failed"] = repr(pg.failed())  # the cut, or a peer's cut that reached this rank first
    pg.abandon()
    store.set(f"after/{rank}", "ok")  # the store outlives the cut: the next generation forms through it
    out["store"] = store.get(f"after/{rank}").decode()
    print(json.dumps(out), flush=True)
    sys.exit(0)
""")


def run_job(tmp_path: Path, where: str, world: int = 4) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), where],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for p in procs[:-1]:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    procs[-1].kill()
    procs[-1].communicate()
    return results


def test_a_severed_rank_waiting_on_a_frozen_peer_is_freed_at_once_not_at_the_timeout(tmp_path: Path) -> None:
    results = run_job(tmp_path, "default")
    for r in results:
        assert "completed" not in r, r  # a collective with a frozen member cannot complete
        assert r["waited_s"] < 10, r  # the group's timeout is 60 s: the cut freed it
        assert r["cut"] > 0 and r["failed"] != "None", r  # the bootstrap sees an interruption
        assert r["store"] == "ok", r
    assert results[0]["waited_s"] < 1, results[0]  # severed before its collective: it fails at once
    assert "n4 was lost (test)" in results[0]["failed"], results[0]  # and says why


def test_a_collective_of_a_subgroup_is_freed_too(tmp_path: Path) -> None:
    results = run_job(tmp_path, "sub")  # rank 1 waits in a subgroup with the frozen rank, the others in the default
    for r in results:
        assert "completed" not in r and r["waited_s"] < 10, r
        assert r["failed"] != "None" and r["store"] == "ok", r


ABANDON_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torchpass.group import TorchPassGroup

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    pg = TorchPassGroup("gloo", dist.PrefixStore("gen1/", store), rank, world, timedelta(seconds=30), local=False)
    pg.allreduce([torch.ones(8)]).wait()
    if rank == world - 1:  # lost: alive, connected, never answers again
        time.sleep(60)
        sys.exit(0)
    pg.allreduce([torch.ones(1 << 20)])  # in flight when the generation fails
    time.sleep(0.5)
    threading.Thread(target=lambda: (time.sleep(1.0), pg.sever("n3 was lost (test)")), daemon=True).start()
    t0 = time.monotonic()
    pg.abandon()  # the bootstrap tearing the failed generation down
    print(json.dumps({"rank": rank, "abandon_s": round(time.monotonic() - t0, 2), "local": pg.local}), flush=True)
""")


def test_a_sever_frees_a_rank_whose_teardown_waits_on_the_lost_peer(tmp_path: Path) -> None:
    """Seen in CI: a rank whose collective failed tears its generation down, and gloo's shutdown
    waits for a collective still in flight with the lost peer until the group's timeout (30 s
    here), holding back the rank's interruption report; the sever that arrives meanwhile cuts what
    is left of the generation's connections, so the teardown ends at once."""
    script = tmp_path / "abandon.py"
    script.write_text(ABANDON_SCRIPT)
    port, world = free_port(), 3
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        for p in procs[:-1]:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-2000:]
            r = json.loads(out.strip().splitlines()[-1])
            assert r["local"] and r["abandon_s"] < 10, r  # without the cut: the 30 s timeout
    finally:
        procs[-1].kill()
        procs[-1].communicate()


def test_a_descriptor_reused_between_the_look_and_the_cut_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sever runs on the reader thread while the training thread may be shutting the group down:
    a descriptor of the group's can be closed and handed to a new connection (a donation's stream)
    between cut's look at it and its cut. The new connection is not cut; the group's still are."""
    old_a, old_b = socket.socketpair()
    new_a, new_b = socket.socketpair()
    with old_a, old_b, new_a, new_b:
        group_sockets = {severing_target(old_a)}
        real_readlink = os.readlink

        def stale_readlink(path: str) -> str:  # what the fd held a moment ago: one of the group's sockets
            return severing_target(old_a) if path.endswith(f"/{new_a.fileno()}") else real_readlink(path)
        monkeypatch.setattr(os, "readlink", stale_readlink)
        assert severing.cut(group_sockets) == 1  # old_a itself, not the reused descriptor
        new_b.sendall(b"still open")
        assert new_a.recv(16) == b"still open"
        assert old_b.recv(16) == b""  # the group's connection was cut: its peer sees it close


def severing_target(sock: socket.socket) -> str:
    return os.readlink(f"/proc/self/fd/{sock.fileno()}")


def test_a_forked_child_disowns_the_parents_connections_and_the_parent_keeps_them() -> None:
    """What a DataLoader's forked worker does at fork (torchpass.runtime): its copies of the worker's
    connections (a listening socket bound to the node's address among them) point at /dev/null, so
    criu finds none of them in the child; the parent's stay whole and usable."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    a, b = socket.socketpair()
    other = socket.socket()  # not the worker's: left alone
    held = {f"socket:[{os.fstat(s.fileno()).st_ino}]" for s in (listener, a)}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it disowned and what its descriptors are now
        count = severing.disown(held)
        now = [os.readlink(f"/proc/self/fd/{s.fileno()}") for s in (listener, a, other)]
        os.write(w, json.dumps([count, now]).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        count, now = json.loads(f.read())
    os.waitpid(pid, 0)
    assert count == 2 and now[:2] == ["/dev/null", "/dev/null"] and now[2].startswith("socket:[")
    a.sendall(b"still here")  # the parent's connection is whole
    assert b.recv(16) == b"still here"
    assert listener.getsockname()[1] > 0
    for s in (listener, a, b, other):
        s.close()
