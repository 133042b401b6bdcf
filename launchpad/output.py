"""Per-rank worker output, routed as torchrun routes it: by default bytes as they are to launchpad's
stdout/stderr; --redirects to ``<log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/{stdout,stderr}.log``
only; --tee to that file and to the console as ``[<role><local_rank>]:``-prefixed lines (or
--log-line-prefix-template's); --local-ranks-filter. Also where launchpad's own full log goes
(:func:`own_log_file`). Starting workers and parsing the options live elsewhere."""

from __future__ import annotations

import asyncio
import codecs
import locale
import os
import re
import string
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from launchpad.spec import STD_ERR, STD_OUT, LaunchSpec
from torchpass_common.errors import ConfigError

HOLD = 0.1  # seconds a partial line (no newline yet) waits for its end before it is shown as it is
_CHUNK = 1 << 16
_HOLD_MAX = 1 << 20  # a partial line this long is shown at once
_NEWLINE = re.compile(r"\r\n|\r|\n")  # universal newlines: how torchrun's tee reads the log files
_TEMP_PREFIX = "torchelastic_"  # torchrun's name for the log root it makes when --log-dir is not given
_run_dirs: dict[tuple[str | None, str], Path] = {}


def line_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """The prefix of each teed console line, as torchrun makes it: ``[<role><local_rank>]:``, or
    the template with ``${role_name}``, ``${rank}`` (global) and ``${local_rank}`` filled in (also
    written ``$rank``...); other ``$`` placeholders stay as written, ``$$`` is one ``$``."""
    if not template:
        return f"[{role}{local_rank}]:"
    return string.Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)


def _safe(text: str) -> str:
    return re.sub(r"[^\w.-]", "_", text)


def run_dir(spec: LaunchSpec) -> Path:
    """This run's log directory, made once per process: ``<log_dir>/<run_id>_<random>`` like
    torchrun's, under a fresh ``torchelastic_*`` temporary directory when --log-dir is not given."""
    key = (spec.log_dir, spec.run_id)
    if key not in _run_dirs:
        try:
            base = spec.log_dir or tempfile.mkdtemp(prefix=_TEMP_PREFIX)
            os.makedirs(base, exist_ok=True)
            _run_dirs[key] = Path(tempfile.mkdtemp(prefix=f"{_safe(spec.run_id)}_", dir=base))
        except OSError as exc:
            raise ConfigError(f"cannot make the log directory for run {spec.run_id} under "
                              f"{spec.log_dir or tempfile.gettempdir()}: {exc}",
                              hint="give --log-dir a writable directory") from exc
    return _run_dirs[key]


def own_log_file(spec: LaunchSpec, env: Mapping[str, str]) -> Path:
    """Where launchpad's own full log goes (its console shows warnings only, like torchrun's):
    ``$TORCHPASS_LOG_DIR/launchpad_<run_id>_<node>_<random>.log`` when that is set, else
    ``launchpad.log`` in this run's log directory with --log-dir, else the same name as the first
    under the system temp dir. Created empty, readable by its owner only."""
    where = env.get("TORCHPASS_LOG_DIR") or None
    try:
        if where is None and spec.log_dir:
            path = run_dir(spec) / "launchpad.log"
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
            return path
        if where is not None:
            os.makedirs(where, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f"launchpad_{_safe(spec.run_id)}_{_safe(str(spec.node))}_",
                                    suffix=".log", dir=where)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(f"cannot create launchpad's log file under {where or tempfile.gettempdir()}: {exc}",
                          hint="set TORCHPASS_LOG_DIR to a writable directory") from exc
    return Path(name)


def _line_end(data: bytes) -> int:
    """Where the last whole line of ``data`` ends (0: none). A final ``\r`` may be half of ``\r\n``."""
    return max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)) + 1


def _tee_lines(text: str) -> Iterator[str]:
    """``text`` in lines ending in ``\n`` (from ``\r\n``, ``\r`` or ``\n``); a last one may have none."""
    pos = 0
    for m in _NEWLINE.finditer(text):
        yield text[pos:m.start()] + "\n"
        pos = m.end()
    if pos < len(text):
        yield text[pos:]


class _Console:
    """One worker stream's way to launchpad's stdout or stderr: its bytes as they are, or (teed)
    decoded as torchrun's tee reads its files, each line behind ``prefix``."""

    def __init__(self, out: BinaryIO, prefix: str | None, encoding: str | None) -> None:
        self.out, self.prefix, self.encoding = out, prefix, encoding or "utf-8"
        self._decoder = (codecs.getincrementaldecoder(locale.getpreferredencoding(False))(errors="replace")
                         if prefix is not None else None)

    def write(self, data: bytes, final: bool = False) -> None:
        if self._decoder is not None:
            text = self._decoder.decode(data, final)
            data = "".join(self.prefix + line for line in _tee_lines(text)).encode(self.encoding, "replace")  # type: ignore[operator]
        if data:
            self.out.write(data)
            self.out.flush()


class Withheld:
    """A joining worker's console output, kept back until its migration succeeded: ``release``
    writes what was kept, in order, and lets the rest through as it comes; ``discard`` (the
    migration was given up) drops it and what follows, so a joiner that never took its rank's
    place leaves no line in the job's output. Its --redirects/--tee files are written as usual.
    At most ``limit`` bytes are kept; what comes beyond is dropped and counted."""

    def __init__(self, limit: int = 8 << 20) -> None:
        self.state = "held"  # held | released | discarded
        self.limit, self.dropped = limit, 0
        self._kept: list[tuple[_Console, bytes, bool]] = []
        self._size = 0

    def write(self, console: _Console, data: bytes, final: bool) -> None:
        if self.state == "released":
            console.write(data, final)
        elif self.state == "held" and self._size + len(data) <= self.limit:
            self._kept.append((console, data, final))
            self._size += len(data)
        else:
            self.dropped += len(data)

    def release(self) -> None:
        if self.state != "held":
            return
        self.state = "released"
        for console, data, final in self._kept:
            console.write(data, final)
        self._kept.clear()

    def discard(self) -> bytes:
        """Drop what was kept (returned, e.g. for launchpad's own log) and all that follows."""
        kept = b"".join(data for _, data, _ in self._kept)
        self.state, self._kept = "discarded", []
        return kept


class _HeldConsole:
    """A console whose writes go through a worker's Withheld."""

    def __init__(self, console: _Console, withheld: Withheld) -> None:
        self.console, self.withheld = console, withheld

    def write(self, data: bytes, final: bool = False) -> None:
        self.withheld.write(self.console, data, final)


class OutputRouter:
    """Where one attempt's worker output goes, by torchrun's rules: a redirected or teed stream is
    written to its file as it comes; it reaches the console only when teed (prefixed lines) or not
    redirected at all (bytes as they are); local ranks left out by --local-ranks-filter reach only
    their files. ``stdout``/``stderr``: the binary consoles (default: launchpad's own); ``local``:
    a local rank's own (a srun python task's streams, task_handover)."""

    def __init__(self, spec: LaunchSpec, attempt: int, *, stdout: BinaryIO | None = None,
                 stderr: BinaryIO | None = None, local: Mapping[int, tuple[BinaryIO, BinaryIO]] | None = None) -> None:
        self.spec = spec
        self._consoles = {"stdout": stdout, "stderr": stderr}
        self._local = dict(local or {})
        self.dir: Path | None = None
        if spec.log_dir or any(spec.redirects.values()) or any(spec.tee.values()):
            self.dir = run_dir(spec) / f"attempt_{attempt}"
            self.dir.mkdir(parents=True, exist_ok=True)

    def _modes(self, local_rank: int, stream: str) -> tuple[bool, bool]:
        """(written to a file, teed) for one stream of one local rank."""
        bit = STD_OUT if stream == "stdout" else STD_ERR
        teed = bool(self.spec.tee.get(local_rank, 0) & bit)
        return teed or bool(self.spec.redirects.get(local_rank, 0) & bit), teed

    def files_for(self, local_rank: int) -> dict[str, Path] | None:
        """The log files of the local rank's redirected or teed streams; its directory is made
        even when there are none (as torchrun does). None without a log directory."""
        if self.dir is None:
            return None
        d = self.dir / str(local_rank)
        d.mkdir(parents=True, exist_ok=True)
        return {s: d / f"{s}.log" for s in ("stdout", "stderr") if self._modes(local_rank, s)[0]}

    def to_console(self, local_rank: int, stream: str) -> bool:
        if self.spec.console_ranks is not None and local_rank not in self.spec.console_ranks:
            return False
        to_file, teed = self._modes(local_rank, stream)
        return teed or not to_file

    def prefix(self, rank: int, local_rank: int) -> str:
        return line_prefix(self.spec.log_line_prefix_template, self.spec.role, rank, local_rank)

    def _console(self, rank: int, local_rank: int, stream: str) -> _Console | None:
        if not self.to_console(local_rank, stream):
            return None
        text = sys.stdout if stream == "stdout" else sys.stderr
        own = self._local.get(local_rank)
        out = (own[0] if stream == "stdout" else own[1]) if own else self._consoles[stream] or text.buffer
        teed = self._modes(local_rank, stream)[1]
        return _Console(out, self.prefix(rank, local_rank) if teed else None, getattr(text, "encoding", None))

    async def pump(self, reader: asyncio.StreamReader, rank: int, local_rank: int, stream: str,
                   withheld: Withheld | None = None) -> None:
        """Copy one stream until EOF: to its file as it comes, to the console in whole lines (a
        partial line is shown as it is after HOLD seconds, or at EOF, without a newline added);
        through ``withheld`` (a joiner's) when given."""
        files = self.files_for(local_rank) or {}
        sink: BinaryIO | None = open(files[stream], "ab") if stream in files else None  # noqa: SIM115 - closed below
        console: _Console | _HeldConsole | None = self._console(rank, local_rank, stream)
        if console is not None and withheld is not None:
            console = _HeldConsole(console, withheld)
        loop = asyncio.get_running_loop()
        pending, since = b"", 0.0
        try:
            while True:
                if pending:
                    left = since + HOLD - loop.time()
                    try:
                        if left <= 0:
                            raise TimeoutError
                        chunk = await asyncio.wait_for(reader.read(_CHUNK), left)
                    except TimeoutError:
                        console.write(pending)  # type: ignore[union-attr]
                        pending = b""
                        continue
                else:
                    chunk = await reader.read(_CHUNK)
                if not chunk:
                    break
                if sink is not None:
                    sink.write(chunk)
                    sink.flush()
                if console is None:
                    continue
                data = pending + chunk
                cut = _line_end(data)
                if cut:
                    console.write(data[:cut])
                if cut or not pending:
                    since = loop.time()
                pending = data[cut:]
                if len(pending) >= _HOLD_MAX:
                    console.write(pending)
                    pending = b""
        finally:
            if console is not None:
                console.write(pending, final=True)
            if sink is not None:
                sink.close()
