"""The launch specification: what one launchpad run was asked to do, built from torchrun-style
options plus, under Slurm, the job's SLURM_* environment. Pure parsing and validation; starting
processes, rendezvous and the control plane live elsewhere."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from torchpass_common.errors import ConfigError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3


@dataclass(frozen=True)
class LaunchSpec:
    """One launchpad invocation. ``node_rank`` None means "assign through the rendezvous store";
    ``redirects``/``tee`` map local rank to a 0-3 mask (1 stdout, 2 stderr) like torchrun's."""

    entrypoint: str
    args: tuple[str, ...] = ()
    nnodes_min: int = 1
    nnodes_max: int = 1
    nproc_per_node: int = 1
    node_rank: int | None = None
    rdzv_backend: str = "static"
    rdzv_host: str = DEFAULT_MASTER_ADDR
    rdzv_port: int = DEFAULT_MASTER_PORT
    run_id: str = "none"
    max_restarts: int = 0
    module: bool = False
    no_python: bool = False
    log_dir: str | None = None
    redirects: Mapping[int, int] = field(default_factory=dict)
    tee: Mapping[int, int] = field(default_factory=dict)
    console_ranks: frozenset[int] | None = None  # --local-ranks-filter; None shows every local rank
    log_line_prefix_template: str | None = None  # teed lines' prefix; None: torchrun's [<role><local_rank>]:
    output_args: tuple[str, ...] = ()  # the output options above as given, for a spare's launchpad to repeat
    role: str = "default"
    monitor_interval: float = 0.1
    join_timeout: float = 600.0
    last_call: float = 2.0
    grace_period: float = 15.0
    job: str | None = None
    node: str | None = None
    hot_spare: bool = False  # --torchpass-spares: this node holds a warm standby instead of ranks
    as_tasks: bool = False  # srun python: each worker is one of the step's tasks (torchpass_common.task_handover)
    first_task_env: Mapping[str, str] = field(default_factory=dict)  # as_tasks: launchpad's, as its task had it

    @property
    def elastic(self) -> bool:
        return self.nnodes_min != self.nnodes_max


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` as torchrun accepts them."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if not m:
        raise ConfigError(f"--nnodes must be N or MIN:MAX, got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_nproc(text: str) -> int:
    """An int, or ``cpu``/``auto`` (CPU count here: the machine has no accelerators torch sees)
    or ``gpu`` (CUDA device count; an error without CUDA)."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text in ("cpu", "auto", "gpu"):
        import torch  # deferred: the CLI's --help should not pay for importing torch

        if text == "gpu" or (text == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise ConfigError("--nproc-per-node=gpu but CUDA is not available on this node",
                                  hint="give a number, or cpu")
            return torch.cuda.device_count()
        return os.cpu_count() or 1
    raise ConfigError(f"--nproc-per-node must be a positive integer, cpu, gpu or auto, got {text!r}")


def parse_std_mask(text: str, nproc: int) -> dict[int, int]:
    """torchrun's ``--redirects``/``--tee``: ``"3"`` for every local rank or ``"0:1,1:2"``."""
    text = text.strip()
    try:
        if ":" not in text:
            mask = int(text)
            result = dict.fromkeys(range(nproc), mask)
        else:
            result = {}
            for part in text.split(","):
                rank, _, value = part.partition(":")
                result[int(rank)] = int(value)
    except ValueError as exc:
        raise ConfigError(f"--redirects/--tee must be 0-3 or LOCAL_RANK:MASK,... got {text!r}") from exc
    if any(not STD_NONE <= v <= STD_ALL for v in result.values()):
        raise ConfigError(f"--redirects/--tee masks must be 0 (none) to 3 (both), got {text!r}")
    return result


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    """torchrun's ``--local-ranks-filter``: ``"0,2"``; empty means every local rank."""
    if not text.strip():
        return None
    try:
        return frozenset(int(r) for r in text.split(","))
    except ValueError as exc:
        raise ConfigError(f"--local-ranks-filter must be comma-separated local ranks, got {text!r}") from exc


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` (IPv6 in brackets) into host and port."""
    m = re.fullmatch(r"\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?|(?P<host>[^:]+)(?::(?P<port>\d+))?", text.strip())
    if not m:
        raise ConfigError(f"--rdzv-endpoint must be HOST[:PORT], got {text!r}")
    host = m.group("v6") or m.group("host")
    port = m.group("p6") or m.group("port")
    return host, int(port) if port else default_port


MODE_ENV = "TORCHPASS"  # the job's --torchpass mode, set by the SPANK plugin in every task
SPARES_ENV = "TORCHPASS_SPARES"  # the job's --torchpass-spares=N, set by the SPANK plugin with the mode


def torchpass_job(env: Mapping[str, str]) -> str | None:
    """The job launchpad reports to: the Slurm job id, in a job submitted with ``--torchpass``
    (the SPANK plugin marks its tasks with TORCHPASS=<mode>); None elsewhere (plain launcher)."""
    return env.get("SLURM_JOB_ID") if env.get(MODE_ENV) else None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist (``n[3-5,7],m1`` -> ``n3``) without calling Slurm."""
    m = re.match(r"([^,\[]+)(?:\[(\d+))?", nodelist.strip())
    if not m:
        raise ConfigError(f"cannot read the first host of SLURM_JOB_NODELIST={nodelist!r}",
                          hint="pass --rdzv-endpoint or --master-addr")
    return m.group(1) + (m.group(2) or "")


@dataclass(frozen=True)
class SlurmHints:
    """What the job's SLURM_* environment says about this node's place, when one task runs per node."""

    node_rank: int | None
    nnodes: int | None
    first_host: str | None
    job_id: str | None
    spares: int = 0  # --torchpass-spares=N: the step's last N nodes are hot spares

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmHints:
        nnodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
        ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
        one_per_node = nnodes is not None and ntasks == nnodes
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        return cls(
            node_rank=int(env["SLURM_NODEID"]) if one_per_node and "SLURM_NODEID" in env else None,
            nnodes=int(nnodes) if one_per_node else None,
            first_host=first_slurm_host(nodelist) if nodelist else None,
            job_id=env.get("SLURM_JOB_ID"),
            spares=_spares(env),
        )


def _spares(env: Mapping[str, str]) -> int:
    """--torchpass-spares=N of a TorchPass job (0 elsewhere, or when the value is not a count)."""
    raw = env.get(SPARES_ENV, "0") if env.get(MODE_ENV) else "0"
    return int(raw) if raw.isdigit() else 0


def split_hot_spares(slurm: SlurmHints, lo: int, hi: int) -> tuple[int, int, bool]:
    """``--torchpass-spares=N``: the step's last N nodes (by SLURM_NODEID) hold a warm standby
    instead of ranks, for torchpassd to rebuild a lost node's ranks on at once. Returns the training
    nodes' --nnodes (MIN, MAX) and whether this node is a hot spare. An --nnodes that counts every
    node of the step (``--nnodes $SLURM_NNODES``) counts the spares too: they are taken off it.
    Nothing changes without one task a node, or when the spares would leave no node to train."""
    if not slurm.spares or hot_spares_ignored(slurm):
        return lo, hi, False
    train = slurm.nnodes - slurm.spares
    if hi == slurm.nnodes:
        lo, hi = min(lo, train), train
    return lo, hi, slurm.node_rank >= train


def hot_spares_ignored(slurm: SlurmHints) -> str:
    """Why this job's ``--torchpass-spares`` cannot be honoured (every node then trains), or ""."""
    if not slurm.spares:
        return ""
    if slurm.nnodes is None or slurm.node_rank is None:
        return "the step does not run one task a node (srun --ntasks-per-node=1, as torchrun wants)"
    if slurm.spares >= slurm.nnodes:
        return f"the step has {slurm.nnodes} nodes: no node would be left to train"
    return ""
