"""Cutting a process group's connections from outside its collectives: how a surviving rank that
sits in a collective with a lost (or frozen) peer is freed at once instead of at the backend's
timeout (launchpad asks for it the moment torchpassd decided a node lost; see agent.py's reader).

gloo has no abort that frees a waiting collective: on torch 2.13 ``ProcessGroupGloo.abort()``
returns, and the collective still waits out its whole timeout (measured; a rank's own failure
does not reach the ranks waiting on other peers either). So the sockets a gloo group opened are
noted when it is built (the stream sockets this process gained meanwhile, by inode) and cut with
``shutdown()``: gloo keeps owning the descriptors, and its pending and later collectives fail at
once with "Connection closed by peer". Listening sockets are never touched (gloo's accept loop
ends the process on a shut-down listener). NCCL is aborted through its own ``abort()``
(ncclCommAbort), which frees a waiting collective. A process forked from a worker (a DataLoader's
worker) gets copies of those sockets it never uses; ``disown`` points them at /dev/null there.
This module owns the socket bookkeeping; when to cut is the worker agent's business, which groups
to cut is group.py's."""

from __future__ import annotations

import contextlib
import os
import socket

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> set[str]:
    """The sockets this process holds now ("socket:[inode]")."""
    found = set()
    for fd in os.listdir(_FD_DIR):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"{_FD_DIR}/{fd}")
            if target.startswith("socket:"):
                found.add(target)
    return found


def cut(inodes: set[str]) -> int:
    """Shut down every connected stream socket among ``inodes`` that this process still holds
    (both directions: the peer sees the connection close, a local wait on it fails); returns how
    many were cut. Listening and datagram sockets are left alone."""
    count = 0
    for fd in os.listdir(_FD_DIR):
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") not in inodes:
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # closed meanwhile, or not a socket any more
            continue
        with sock:
            try:
                if f"socket:[{os.fstat(sock.fileno()).st_ino}]" not in inodes:
                    continue  # the descriptor was closed (its group shutting down) and reused meanwhile
                if sock.type != socket.SOCK_STREAM or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:  # already shut down, or never connected
                continue
    return count


def disown(inodes: set[str]) -> int:
    """In a process forked from a worker: point every descriptor of a socket among ``inodes`` at
    /dev/null (returns how many). The parent's connections stay whole (only this copy goes), and a
    criu move of the worker's process tree no longer finds, in its children, a listening socket
    bound to the old node's address (which cannot be bound on the spare). /dev/null rather than a
    close: the objects that own the descriptors may still close them, and must not close a reused one."""
    if not inodes:
        return 0
    count = 0
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError):
                if int(fd) != null and os.readlink(f"{_FD_DIR}/{fd}") in inodes:
                    os.dup2(null, int(fd), inheritable=False)
                    count += 1
    finally:
        os.close(null)
    return count
