"""Taking a node out of service from TorchPass's side: drain it with a reason operators read in
``sinfo -R`` / ``torchpassctl nodes`` (the GPU health policy uses it). Slurm's own drain then
drives the normal planned migration; resuming a node stays an operator decision."""

from __future__ import annotations

from slurm_plugin.runner import SlurmRunner
from torchpass_common import log


def drain(runner: SlurmRunner, node: str, reason: str) -> None:
    """``scontrol update nodename=NODE state=drain reason=REASON``; SlurmError if refused."""
    runner.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"], node=node)
    log.get(node=node).warning("node.drained_by_torchpass", reason=reason)
