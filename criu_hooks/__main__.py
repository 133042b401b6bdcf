"""`python -m criu_hooks check [--json]`: which criu TorchPass uses and why (or why none works).
`python -m criu_hooks restore IMAGES`: restore a dumped worker and stay its parent (a subreaper), print
{"pid", "seconds"} as one JSON line, then exit with the worker's own exit status, like the worker."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from criu_hooks import locate, runner
from criu_hooks.errors import CriuFailed, CriuUnavailable


@click.group()
def main() -> None:
    """TorchPass CRIU helpers."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON document on stdout")
def check(as_json: bool) -> None:
    """Probe every criu candidate and say which one is used."""
    found = locate.probe_all()
    chosen = next((c for c in found if c.ok), None)
    if as_json:
        click.echo(json.dumps({
            "chosen": chosen.path if chosen else None,
            "version": chosen.version_text if chosen else None,
            "candidates": [{"source": c.source, "path": c.path, "version": c.version_text, "ok": c.ok,
                            "reason": c.reason} for c in found]}))
    else:
        for c in found:
            click.echo(f"{'USE ' if c is chosen else 'skip'} {c.source:8} {c.path}  {c.version_text}  {c.reason}")
        if chosen is None:
            click.echo(f"no usable criu: {locate.INSTALL_HINT}", err=True)
    sys.exit(0 if chosen else 1)


@main.command()
@click.argument("images", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--no-tcp-close", is_flag=True, help="the dump was made without --tcp-close")
def restore(images: Path, no_tcp_close: bool) -> None:
    """Restore IMAGES, print the restored pid, wait for it and exit with its status."""
    runner.become_subreaper()
    try:
        done = runner.restore(images, tcp_close=not no_tcp_close)
    except (CriuFailed, CriuUnavailable) as e:
        click.echo(json.dumps({"error": str(e)}))
        sys.exit(1)
    click.echo(json.dumps({"pid": done.pid, "seconds": done.seconds}))
    sys.stdout.flush()
    _, status = os.waitpid(done.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    sys.exit(code if code >= 0 else 128 - code)  # killed by a signal: 128 + its number, as a shell says


if __name__ == "__main__":
    main()
