"""Per-rank worker output: each worker's stdout and stderr are read line by line and written to
``<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout,stderr}.log`` and/or to launchpad's own
stdout/stderr with a ``[rank]:`` prefix, following torchrun's --log-dir/--redirects/--tee."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import BinaryIO

from launchpad.spec import STD_ERR, STD_OUT, LaunchSpec


class OutputRouter:
    """Where one attempt's worker output goes. With a log dir every stream is kept in a file;
    a stream is shown on the console unless it is redirected (to a log dir) and not teed, or its
    local rank is left out by --local-ranks-filter."""

    def __init__(self, spec: LaunchSpec, attempt: int) -> None:
        self.spec = spec
        self.dir = Path(spec.log_dir) / spec.run_id / f"attempt_{attempt}" if spec.log_dir else None

    def files_for(self, local_rank: int) -> dict[str, Path] | None:
        if self.dir is None:
            return None
        d = self.dir / str(local_rank)
        d.mkdir(parents=True, exist_ok=True)
        return {"stdout": d / "stdout.log", "stderr": d / "stderr.log"}

    def to_console(self, local_rank: int, stream: str) -> bool:
        if self.spec.console_ranks is not None and local_rank not in self.spec.console_ranks:
            return False
        bit = STD_OUT if stream == "stdout" else STD_ERR
        redirected = self.spec.redirects.get(local_rank, 0) & bit
        teed = self.spec.tee.get(local_rank, 0) & bit
        return not redirected or bool(teed) or self.dir is None

    async def pump(self, reader: asyncio.StreamReader, rank: int, local_rank: int, stream: str) -> None:
        """Copy one stream until EOF; lines to the console get the ``[rank]:`` prefix."""
        files = self.files_for(local_rank)
        sink: BinaryIO | None = open(files[stream], "ab") if files else None  # noqa: SIM115 - closed below
        console = (sys.stdout if stream == "stdout" else sys.stderr).buffer if self.to_console(local_rank, stream) else None
        prefix = f"[{rank}]:".encode()
        try:
            while line := await reader.readline():
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if console is not None:
                    console.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    console.flush()
        finally:
            if sink is not None:
                sink.close()
