"""The identities of a rank's process groups (c10d name, global ranks, backend; in the order its
script made them) as the hand-over record carries them, and a joining rank's check of its own
against those of the rank it replaces. What the joiner's script made before register() must be
what the replaced rank made first; the replaced rank's later groups (made in its training loop,
before the migration) are adopted, so that the re-form builds them with the survivors and the
script's own later new_group of one gets it back. Any other difference means the ranks disagree
about their groups (a different mesh): an error naming the first differing group, raised before
the joiner reports joined, so that the migration is rolled back and the job goes on where it was.
It does not build groups (group.py) or decide when to check (agent.py)."""

from __future__ import annotations

from typing import Any

from torchpass.group import TorchPassGroup
from torchpass_common.errors import WorkerError


def identities(group: TorchPassGroup) -> list[dict[str, Any]]:
    """The live subgroups of the default ``group``, in creation order."""
    return [{"name": sub.group_name, "ranks": list(sub.ranks), "backend": sub.backend}
            for sub in group.subgroups if not sub.destroyed]


def _text(ident: dict[str, Any]) -> str:
    return f"{ident['name']!r} (ranks {ident['ranks']}, {ident['backend']})"


def reconcile(group: TorchPassGroup, replaced: list[dict[str, Any]], *, rank: int) -> list[str]:
    """Check this joining rank's groups against ``replaced`` (the identities in the record of the
    rank it takes over) and adopt the ones made there later; returns their names."""
    mine = identities(group)
    hint = ("every rank must make the same process groups (DeviceMesh, new_group...) in the same order, "
            "whatever node it runs on")
    for mine_one, theirs in zip(mine, replaced, strict=False):
        if mine_one != theirs:
            raise WorkerError(f"this joining rank made process group {_text(mine_one)} where the rank it replaces "
                              f"made {_text(theirs)}: the ranks disagree about the mesh", hint=hint, rank=rank)
    if len(mine) > len(replaced):
        raise WorkerError(f"this joining rank made process group {_text(mine[len(replaced)])}, which the rank it "
                          f"replaces did not have: the ranks disagree about the mesh", hint=hint, rank=rank)
    later = replaced[len(mine):]
    for ident in later:
        group.adopt(ident["name"], list(ident["ranks"]), ident["backend"])
    return [ident["name"] for ident in later]
