"""The planned, model-transparent migration (jobs run with --torchpass=transparent): planned.py's
flow with the worker process itself moved by criu instead of a save()/load() hand-over. Preflight
first, before anything is paused: refused -> the model-aware flow when the script registered
save/load, else the job keeps running and the move waits. Then spare added -> its launchpad started
empty -> all ranks pause at step S -> page server + receiver on the spare -> dump on the source ->
restore on the spare -> re-form as G+1 with the restored rank -> resume -> the stopped original
discarded. A failure after the dump brings the original back (resume_original) and re-forms."""

from __future__ import annotations

import asyncio
import subprocess
import time
from typing import Any

from slurm_plugin.model import TRANSPARENT
from torchpass_common import agent_channel as ac
from torchpass_common.errors import MigrationError, TorchPassError
from torchpass_common.transfer_address import TransferAddress
from torchpassd import journal as jn
from torchpassd import planned
from torchpassd.commander import CommandFailed

MODE = "planned-transparent"
PAGE_PORT_BASE = 29500  # the spare's criu page server for local worker i: planned.joiner_port(BASE + generation, i)
PREFLIGHT = "preflight"


class TransparentMigration(planned.PlannedMigration):
    """One criu move of every worker of ``plan.source``; ``run()`` drives it to an end."""

    mode = MODE

    async def run(self) -> str:
        p = self.plan
        p.ranks = self.view().ranks_on(p.source)
        if not p.ranks:
            await self.phase(planned.ROLLED_BACK, jn.ROLLED_BACK, error=f"{p.source} runs no rank of the job")
            return jn.ROLLED_BACK
        p.rank = p.ranks[0]
        reasons, registered, pids = [], True, []
        for rank in p.ranks:
            try:
                check = await self.send(p.source, "preflight", p.gen, {"rank": rank}, timeout=self.t.reform)
            except TorchPassError as exc:
                check = {"reasons": [f"preflight failed: {exc}"], "registered": False}
            reasons += [f"rank {rank}: {r}" for r in check["reasons"]] if len(p.ranks) > 1 else check["reasons"]
            registered = registered and bool(check.get("registered"))
            pids.append(check.get("pid"))
        if reasons:
            return await self._refused(reasons, registered)
        await self.phase(PREFLIGHT, pid=pids[0] if len(pids) == 1 else pids)
        try:
            await self._prepare()
            await self._pause()
        except TorchPassError as exc:
            await self.roll_back(self.failed_before_hand_over(exc))
            return jn.ROLLED_BACK
        try:
            await self._hand_over()
        except TorchPassError as exc:
            return await self._reform_back(f"moving ranks {p.ranks} to {p.target} failed: {exc}")
        return await self.finish()

    async def _refused(self, reasons: list[str], registered: bool) -> str:
        """Nothing was paused or taken yet: fall back to the model-aware flow, or let the job wait."""
        why = "; ".join(reasons)
        if registered:
            await self.phase(PREFLIGHT, refused=reasons, fallback=planned.MODE)
            self.log.warning("migration.transparent_refused", reasons=reasons, fallback=planned.MODE)
            aware = planned.PlannedMigration(self.d, self.plan, self.id, detected_at=self.detected_at)
            return await aware.run()
        self.log.warning("migration.transparent_refused", reasons=reasons, fallback="wait")
        self.d.metrics.migrations_total.inc(mode=self.mode, outcome="rolled_back")
        await self.phase(planned.ROLLED_BACK, jn.ROLLED_BACK, refused=reasons,
                         error=f"transparent migration refused before any pause: {why}; the script registered "
                               "no save/load for a model-aware move, so the job keeps running here and the "
                               "move is retried")
        return jn.ROLLED_BACK

    async def _prepare(self) -> None:
        p = self.plan
        p.survivors = self._others_training()
        p.target, p.target_addr = await self._take_spare()
        p.port = planned.WORMHOLE_PORT_BASE + p.new_gen
        await self.phase(planned.SPARE_CHOSEN, detect_s=round(time.time() - self.detected_at, 3))
        await self._add_spare_to_job(p.target)
        await self.phase(planned.SPARE_ADDED)
        tpl = await self._template(p.source, p.rank)
        self._adopt_template(tpl)
        await self._start_restorer(tpl)
        await self.phase(planned.JOINER_READY)

    async def _start_restorer(self, tpl: planned.WorkerTemplate) -> None:
        """launchpad on the spare, started with no worker (TORCHPASS_RESTORE_TARGET): it will hold
        the restored one. Ready once it is online on the control plane."""
        p = self.plan
        config = tpl.env.get("TORCHPASS_CONFIG") or self.d.cfg.source
        argv = [tpl.python, "-m", "launchpad", "--job", p.job, "--node", p.target,
                *(["--config", config] if config else []), "--nnodes", "1", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{p.store_host}:{p.store_port}",
                "--rdzv-id", f"{p.job}-restore-{self.id[:8]}", *tpl.output_args(), "--no-python", "true"]
        env = {ac.ENV_RESTORE_TARGET: "1"}
        self.d.steps_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.d.steps_dir / f"{p.job}-{self.id[:8]}-{p.target}.log", "ab")  # noqa: SIM115 - the step owns it
        try:
            proc = await asyncio.to_thread(self.d.resizer.start_step, int(p.job), p.target, argv, mode=TRANSPARENT,
                                           extra_env=env, job_output=True, stdout=out, stderr=subprocess.STDOUT, cwd=tpl.cwd or None,
                                           start_new_session=True)
        finally:
            out.close()
        self.d.steps[self._step_key(p.target)] = proc
        asyncio.get_running_loop().run_in_executor(None, proc.wait)  # reap it whenever it ends

        def online() -> bool | None:
            if proc.poll() is not None:
                raise MigrationError(f"the spare's launchpad step on {p.target} ended (rc={proc.returncode})",
                                     hint=f"see {self.d.steps_dir}", **self.where)
            lp = self.view().launchpads.get(p.target)
            return True if lp is not None and lp.online else None
        await self.d.registry.wait_for(online, self.t.decision, f"the launchpad on {p.target}", **self.where)

    async def _hand_over(self) -> None:
        """prepare_restore on the spare, checkpoint (dump + images) on the source, restore on the
        spare; timed separately in the handed_over phase."""
        p = self.plan

        def moves(images_host: str) -> list[dict[str, Any]]:
            return [{"rank": rank, "page_port": planned.joiner_port(PAGE_PORT_BASE + p.new_gen, i),
                     "images": TransferAddress(images_host, planned.joiner_port(p.port, i), self.token).wire()}
                    for i, rank in enumerate(p.ranks)]
        await self.send(p.target, "prepare_restore", p.gen, {"page_host": p.target_addr, "moves": moves("0.0.0.0")})
        dump = await self.send(p.source, "checkpoint", p.gen, {  # the node's workers are dumped side by side
            "moves": moves(p.target_addr), "page_host": p.target_addr})
        try:
            done = await self.send(p.target, "restore", p.gen, {"ranks": p.ranks})
        except CommandFailed as exc:
            if exc.lasting:  # criu cannot bring these processes back: a retry would fail alike
                self.lasting = f"criu could not restore ranks {p.ranks} on {p.target}"
            raise
        await self.phase(planned.HANDED_OVER, dump_s=dump.get("dump_s"), frozen_s=dump.get("frozen_s"),
                         transfer_s=dump.get("transfer_s"), restore_s=done.get("restore_s"),
                         image_bytes=dump.get("image_bytes"), page_bytes=done.get("page_bytes"))

    async def send(self, node: str, cmd: str, gen: int, args: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        """planned's commands, except that the source's worker leaves by being discarded: planned's
        finish sends "exit" there once the new generation stands, but the original is stopped and
        off its channel by then (its copy runs on the spare)."""
        if cmd == "exit" and node == self.plan.source:
            cmd, args = "discard", {"ranks": self.plan.ranks}
        return await super().send(node, cmd, gen, args, timeout)

    async def _reform_back(self, reason: str) -> str:
        """The move failed after the pause: the original (dumped and stopped, or resumed already
        by a failed dump) goes on in place, then planned's re-form back without the spare."""
        try:
            await self.send(self.plan.source, "resume_original", self.plan.gen, {"ranks": self.plan.ranks},
                            timeout=self.t.reform)
        except TorchPassError as exc:
            self.log.error("migration.resume_original_failed", error=str(exc))
        return await super()._reform_back(reason)

    async def roll_back(self, reason: str) -> None:
        """Before the hand-over. Once paused (a restarted torchpassd cannot tell whether the dump
        began), the source's worker may have released its communicator: re-form back instead of
        resuming the current generation."""
        if self.plan.paused_step >= 0:
            await self._reform_back(reason)
            return
        await super().roll_back(reason)
