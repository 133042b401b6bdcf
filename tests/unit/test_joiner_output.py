"""A joining worker's console output is kept back until its migration succeeded: released in order
at its resume, or dropped (and all that follows) when the migration is given up, so a joiner that
never took its rank's place leaves no line in the job's output. Its log files are written as usual."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from launchpad import output
from launchpad.spec import LaunchSpec


def _router(console: io.BytesIO, **kw: object) -> output.OutputRouter:
    return output.OutputRouter(LaunchSpec(entrypoint="train.py", **kw), 0, stdout=console, stderr=io.BytesIO())


async def _pump(router: output.OutputRouter, withheld: output.Withheld, chunks: list[bytes],
                between: object = None) -> None:
    reader = asyncio.StreamReader()
    task = asyncio.create_task(router.pump(reader, 3, 1, "stdout", withheld))
    for i, chunk in enumerate(chunks):
        reader.feed_data(chunk)
        await asyncio.sleep(0.01)
        if i == 0 and callable(between):
            between()
    reader.feed_eof()
    await asyncio.wait_for(task, 10)


def test_released_output_comes_in_order_and_the_rest_goes_through() -> None:
    console, held = io.BytesIO(), output.Withheld()

    async def main() -> None:
        router = _router(console)
        reader = asyncio.StreamReader()
        task = asyncio.create_task(router.pump(reader, 3, 1, "stdout", held))
        reader.feed_data(b"Loading snapshot\nstep 7\n")
        await asyncio.sleep(0.05)
        assert console.getvalue() == b""  # held while the migration runs
        held.release()
        assert console.getvalue() == b"Loading snapshot\nstep 7\n"
        reader.feed_data(b"step 8\n")
        reader.feed_eof()
        await asyncio.wait_for(task, 10)
    asyncio.run(main())
    assert console.getvalue() == b"Loading snapshot\nstep 7\nstep 8\n"


def test_a_given_up_joiner_leaves_nothing_in_the_console_but_its_files_keep_all(tmp_path: Path) -> None:
    console, held = io.BytesIO(), output.Withheld()
    router = _router(console, log_dir=str(tmp_path), tee={1: 3})
    kept: list[bytes] = []
    asyncio.run(_pump(router, held, [b"Loading snapshot\n", b"epoch 0\n"], between=lambda: kept.append(held.discard())))
    assert console.getvalue() == b""
    assert kept == [b"Loading snapshot\n"]  # for launchpad's own log
    (log,) = tmp_path.rglob("1/stdout.log")
    assert log.read_bytes() == b"Loading snapshot\nepoch 0\n"


def test_what_is_kept_is_bounded() -> None:
    console, held = io.BytesIO(), output.Withheld(limit=10)
    asyncio.run(_pump(_router(console), held, [b"12345\n", b"67890abc\n"]))
    held.release()
    assert console.getvalue() == b"12345\n" and held.dropped == 9
