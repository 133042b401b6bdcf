"""launchpad's worker output routing, as torchrun does it: the prefix template, bytes as they are
by default, teed lines behind a prefix (newlines read the way torchrun's tee reads them), partial
lines, --redirects/--tee files and their layout, --local-ranks-filter, and where launchpad's own
log file goes."""

from __future__ import annotations

import asyncio
import io
import os
import re
import stat
import tempfile
from pathlib import Path

import pytest

from launchpad import cli, output
from launchpad.spec import LaunchSpec
from torchpass_common.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh_run_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(output, "_run_dirs", {})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def spec(**kw: object) -> LaunchSpec:
    return LaunchSpec(entrypoint="train.py", run_id="run7", node="n1", nproc_per_node=2, **kw)  # type: ignore[arg-type]


# -- the prefix -----------------------------------------------------------------------------------

def test_default_prefix_is_role_and_local_rank() -> None:
    assert output.line_prefix(None, "default", 5, 1) == "[default1]:"
    assert output.line_prefix("", "trainer", 5, 0) == "[trainer0]:"  # an empty template: the default


def test_template_fills_role_rank_and_local_rank() -> None:
    assert output.line_prefix("[${rank}]:", "default", 5, 1) == "[5]:"  # global rank
    assert output.line_prefix("${role_name}/${local_rank} ", "trainer", 5, 1) == "trainer/1 "
    assert output.line_prefix("$rank-$local_rank|", "r", 3, 0) == "3-0|"  # without braces too


def test_template_leaves_other_placeholders_and_unescapes_dollars() -> None:
    assert output.line_prefix("${host} $$ ${rank} $", "default", 2, 0) == "${host} $ 2 $"


# -- pumping one stream ---------------------------------------------------------------------------

def pump(s: LaunchSpec, chunks: list[bytes | float], *, rank: int = 0, local_rank: int = 0, stream: str = "stdout",
         attempt: int = 0) -> tuple[bytes, bytes, list[bytes]]:
    """Feed ``chunks`` (a float: wait that long) to one stream's pump; the console's bytes, the
    other console's bytes, and what the console received in each write."""
    consoles = {"stdout": io.BytesIO(), "stderr": io.BytesIO()}
    writes: list[bytes] = []
    target = consoles[stream]
    real_write = target.write
    target.write = lambda b: (writes.append(bytes(b)), real_write(b))[1]  # type: ignore[method-assign]

    async def go() -> None:
        router = output.OutputRouter(s, attempt, stdout=consoles["stdout"], stderr=consoles["stderr"])
        reader = asyncio.StreamReader()
        task = asyncio.create_task(router.pump(reader, rank, local_rank, stream))
        for c in chunks:
            if isinstance(c, float):
                await asyncio.sleep(c)
            else:
                reader.feed_data(c)
                await asyncio.sleep(0.01)  # the pump reads each chunk on its own
        reader.feed_eof()
        await asyncio.wait_for(task, 10)

    asyncio.run(go())
    other = consoles["stderr" if stream == "stdout" else "stdout"].getvalue()
    return target.getvalue(), other, writes


RAW = [b"one\n", b"a\rb\r\n", b"bad \xff\n", b"tab\there\n\n", b"no newline at the end"]


def test_default_copies_bytes_as_they_are_without_prefix() -> None:
    got, other, _ = pump(spec(), RAW)
    assert got == b"".join(RAW) and other == b""  # nothing added, not even the last newline
    got, other, _ = pump(spec(), RAW, stream="stderr")
    assert got == b"".join(RAW) and other == b""


def test_teed_lines_get_the_prefix_and_torchruns_newlines() -> None:
    got, _, _ = pump(spec(tee={0: 3, 1: 3}), RAW)
    assert got == (b"[default0]:one\n[default0]:a\n[default0]:b\n[default0]:bad \xef\xbf\xbd\n"
                   b"[default0]:tab\there\n[default0]:\n[default0]:no newline at the end")


def test_template_prefix_uses_the_workers_ranks() -> None:
    got, _, _ = pump(spec(tee={0: 1, 1: 1}, log_line_prefix_template="<${rank}:${local_rank}> "),
                     [b"x\n", b"y"], rank=3, local_rank=1)
    assert got == b"<3:1> x\n<3:1> y"


def test_template_without_tee_changes_nothing() -> None:
    got, _, _ = pump(spec(log_line_prefix_template="[${rank}]:"), [b"x\n"], rank=1)
    assert got == b"x\n"


def test_crlf_split_between_reads_is_one_newline() -> None:
    got, _, _ = pump(spec(tee={0: 3}), [b"a\r", b"\nb\n"])
    assert got == b"[default0]:a\n[default0]:b\n"


def test_lines_stay_whole_when_they_arrive_in_pieces() -> None:
    got, _, writes = pump(spec(), [b"hel", b"lo wor", b"ld\nnext", b" line\n"])
    assert got == b"hello world\nnext line\n"
    assert writes == [b"hello world\n", b"next line\n"]


def test_a_partial_line_is_shown_after_the_hold_time() -> None:
    got, _, writes = pump(spec(), [b"10%\r20%", 3 * output.HOLD, b"\r30%\n"])
    assert got == b"10%\r20%\r30%\n"
    assert writes == [b"10%\r", b"20%", b"\r30%\n"]  # the progress bar moves while the line is open
    got, _, _ = pump(spec(tee={0: 1}), [b"waiting", 3 * output.HOLD, b" done\n"])
    assert got == b"[default0]:waiting[default0]: done\n"  # as torchrun's tee shows a line caught half-written


def test_multibyte_character_split_between_reads() -> None:
    text = "d\u00e9j\u00e0 \u2713\n".encode()
    got, _, _ = pump(spec(tee={0: 3}), [text[:2], 3 * output.HOLD, text[2:]])
    assert got == b"[default0]:d[default0]:" + "\u00e9j\u00e0 \u2713\n".encode()  # whole characters


# -- files and the console ------------------------------------------------------------------------

def run_dir_of(log_dir: Path) -> Path:
    (run,) = log_dir.iterdir()
    assert re.fullmatch(r"run7_[a-z0-9_]{8}", run.name), run.name  # torchrun's <run_id>_<random>
    return run


def test_redirected_stream_goes_to_its_file_only(tmp_path: Path) -> None:
    s = spec(log_dir=str(tmp_path / "logs"), redirects={0: 1, 1: 0})
    got, _, _ = pump(s, RAW)
    assert got == b""
    run = run_dir_of(tmp_path / "logs")
    assert (run / "attempt_0" / "0" / "stdout.log").read_bytes() == b"".join(RAW)
    assert not (run / "attempt_0" / "0" / "stderr.log").exists()  # stderr was not redirected
    got, _, _ = pump(s, [b"err\n"], stream="stderr")
    assert got == b"err\n" and not (run / "attempt_0" / "0" / "stderr.log").exists()


def test_teed_stream_goes_to_file_as_bytes_and_console_as_lines(tmp_path: Path) -> None:
    s = spec(log_dir=str(tmp_path / "logs"), tee={0: 2})
    got, _, _ = pump(s, [b"a\rb\n"], stream="stderr", attempt=2)
    assert got == b"[default0]:a\n[default0]:b\n"
    assert (run_dir_of(tmp_path / "logs") / "attempt_2" / "0" / "stderr.log").read_bytes() == b"a\rb\n"


def test_log_dir_alone_makes_the_layout_but_no_files(tmp_path: Path) -> None:
    s = spec(log_dir=str(tmp_path / "logs"))
    got, _, _ = pump(s, [b"x\n"], local_rank=1)
    assert got == b"x\n"
    attempt = run_dir_of(tmp_path / "logs") / "attempt_0"
    assert [p.name for p in attempt.iterdir()] == ["1"] and not list((attempt / "1").iterdir())


def test_redirects_without_log_dir_use_a_torchelastic_temp_dir(tmp_path: Path) -> None:
    got, _, _ = pump(spec(redirects={0: 3}), [b"x\n"])
    assert got == b""
    (root,) = (tmp_path / "tmp").iterdir()
    assert root.name.startswith("torchelastic_")
    assert (run_dir_of(root) / "attempt_0" / "0" / "stdout.log").read_bytes() == b"x\n"


def test_nothing_redirected_makes_no_directories(tmp_path: Path) -> None:
    pump(spec(), [b"x\n"])
    assert not list((tmp_path / "tmp").iterdir())


def test_local_ranks_filter_keeps_other_ranks_off_the_console_only(tmp_path: Path) -> None:
    s = spec(console_ranks=frozenset({1}), log_dir=str(tmp_path / "logs"), tee={0: 1})
    assert pump(s, [b"x\n"], local_rank=0) == (b"", b"", [])  # teed: its file only
    assert pump(s, [b"y\n"], local_rank=0, stream="stderr")[0] == b""  # not redirected: nowhere
    assert pump(s, [b"z\n"], local_rank=1)[0] == b"z\n"
    assert (run_dir_of(tmp_path / "logs") / "attempt_0" / "0" / "stdout.log").read_bytes() == b"x\n"


def test_one_run_directory_for_all_attempts(tmp_path: Path) -> None:
    s = spec(log_dir=str(tmp_path / "logs"), redirects={0: 1})
    pump(s, [b"first\n"], attempt=0)
    pump(s, [b"second\n"], attempt=1)
    run = run_dir_of(tmp_path / "logs")
    assert sorted(p.name for p in run.iterdir()) == ["attempt_0", "attempt_1"]


# -- launchpad's own log file ---------------------------------------------------------------------

def test_own_log_file_under_torchpass_log_dir(tmp_path: Path) -> None:
    path = output.own_log_file(spec(log_dir=str(tmp_path / "logs")), {"TORCHPASS_LOG_DIR": str(tmp_path / "oplogs")})
    assert path.parent == tmp_path / "oplogs" and re.fullmatch(r"launchpad_run7_n1_\w{8}\.log", path.name)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not (tmp_path / "logs").exists()  # TORCHPASS_LOG_DIR wins over --log-dir


def test_own_log_file_in_the_run_directory_with_log_dir(tmp_path: Path) -> None:
    s = spec(log_dir=str(tmp_path / "logs"), redirects={0: 1})
    path = output.own_log_file(s, {})
    assert path == run_dir_of(tmp_path / "logs") / "launchpad.log" and path.exists()
    pump(s, [b"x\n"])
    assert (path.parent / "attempt_0" / "0" / "stdout.log").exists()  # the workers' run directory too


def test_own_log_file_in_the_temp_dir_by_default(tmp_path: Path) -> None:
    path = output.own_log_file(spec(), {})
    assert path.parent == tmp_path / "tmp" and path.name.startswith("launchpad_run7_n1_")


def test_own_log_file_that_cannot_be_made_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="TORCHPASS_LOG_DIR"):
        output.own_log_file(spec(), {"TORCHPASS_LOG_DIR": str(tmp_path / "file" / "sub")})


# -- the command line -----------------------------------------------------------------------------

def build(*argv: str, env: dict[str, str] | None = None) -> LaunchSpec:
    old = dict(os.environ)
    os.environ.pop("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", None)
    os.environ.update(env or {})
    try:
        return cli.build_spec(cli.main.make_context("launchpad", list(argv)).params, {})
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_prefix_template_option_both_spellings_and_torchruns_environment() -> None:
    assert build("train.py").log_line_prefix_template is None
    assert build("--log-line-prefix-template", "[${rank}]:", "train.py").log_line_prefix_template == "[${rank}]:"
    assert build("--log_line_prefix_template=<${rank}>", "train.py").log_line_prefix_template == "<${rank}>"
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "${local_rank}|"}
    assert build("train.py", env=env).log_line_prefix_template == "${local_rank}|"
    assert build("--log-line-prefix-template=x", "train.py", env=env).log_line_prefix_template == "x"


def test_output_options_are_kept_as_given_for_a_spare_to_repeat() -> None:
    """A spare's launchpad taking over a node's ranks is started with the node's output options
    (torchpassd reads them back from a worker's TORCHPASS_OUTPUT_ARGS), so the moved ranks' output
    goes on as before: teed, filtered, prefixed, in the log directory."""
    assert build("train.py").output_args == ()
    got = build("--tee", "3", "--local-ranks-filter", "0", "--log-dir", "/logs", "--log-line-prefix-template",
                "<${rank}>", "-r", "0:1", "train.py").output_args
    assert got == ("--log-dir", "/logs", "--redirects", "0:1", "--tee", "3", "--local-ranks-filter", "0",
                   "--log-line-prefix-template", "<${rank}>")
    again = build(*got, "train.py")
    assert again.output_args == got and again.console_ranks == frozenset({0}) and again.log_dir == "/logs"
