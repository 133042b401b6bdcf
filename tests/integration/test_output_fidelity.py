"""launchpad's console is torchrun's: the same worker script run under the venv's real
``torchrun --standalone`` and under ``python -m launchpad --standalone`` with the same options
gives the same stdout bytes and stderr bytes (default, --tee, --log-line-prefix-template,
--local-ranks-filter, --redirects/--log-dir, whose files must match too)."""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_launchpad_training import PYTHON, ROOT, TORCHRUN, launchpad_argv

pytestmark = pytest.mark.slow

GAP = 0.6  # seconds each rank waits after its output before the next rank writes (launchers copy it)

# argv: TURN_DIR. Ranks write in turn (rank r after rank r-1 wrote and waited GAP), so the order of
# lines between processes is the same under both launchers and the bytes can be compared exactly.
# Each write is one system call (python -u, one write() per line), as a line of print() need not be.
# What is written: plain, tab and empty lines; \r and \r\n (progress bars); non-ASCII and a byte
# that is not UTF-8; on both streams a last line without newline (the next rank's first line is
# glued to it by either launcher; the last rank's ends the stream without newline).
SCRIPT = r'''
import os, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
turns = sys.argv[1]
while rank and not os.path.exists(os.path.join(turns, f"turn{rank}")):
    time.sleep(0.01)
out, err = sys.stdout, sys.stderr
out.write(f"rank {rank}: plain line\n")
out.write("\tindented line\n")
out.write("\n")
out.write("progress 10%\rprogress 100%\r\n")
err.write(f"rank {rank}: a line on stderr\n")
out.write("d\u00e9j\u00e0 vu \u2713\n")
out.buffer.write(b"not utf-8: \xff\xfe end\n")
out.buffer.flush()
out.write(f"rank {rank} partial stdout")
err.write(f"rank {rank} partial stderr")
time.sleep(float(sys.argv[2]))
open(os.path.join(turns, f"turn{rank + 1}"), "w").close()
'''

# The launchers' own lines on stderr, the only bytes dropped before comparing. torchrun's logging
# (glog format: level letter, MMDD, time, pid, source file:line) and launchpad's (structlog JSON
# at warning or above) differ in form, never in presence: both only warn that OMP_NUM_THREADS is
# set to 1 when more than one worker runs (asserted below); nothing else may be dropped.
TORCHRUN_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ torch/\S+:\d+\] (.*)\n", re.M)
LAUNCHPAD_LOG = re.compile(rb'^(\{.*"event": "([a-z_]+\.[a-z_.]+)", "level": "(?:warning|error|critical)".*\})\n',
                           re.M)
TORCHRUN_OMP = {b"", b"*****************************************",
                b"Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid "
                b"your system being overloaded, please further tune the variable for optimal performance in "
                b"your application as needed. "}

TEMPLATE = "<${role_name}|${rank}|${local_rank}> $$ ${unknown} "
# id: (nproc, torchrun options, launchpad options, environment of both, with --log-dir)
CASES: dict[str, tuple[int, list[str], list[str], dict[str, str], bool]] = {
    "one-worker": (1, [], [], {}, False),
    "default": (2, [], [], {}, False),
    "tee": (2, ["--tee", "3"], ["--tee", "3"], {}, False),
    "tee-per-rank": (2, ["--tee", "0:1,1:2"], ["--tee", "0:1,1:2"], {}, False),
    # torchrun 2.13 takes the template only from its environment; launchpad also as an option
    "template-option": (2, ["--tee", "3"], ["--tee", "3", "--log-line-prefix-template", TEMPLATE],
                        {"TORCHRUN_ONLY_TEMPLATE": "1"}, False),
    "template-env": (2, ["-t", "3"], ["-t", "3"], {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": TEMPLATE}, False),
    "template-without-tee": (2, [], ["--log_line_prefix_template", TEMPLATE], {"TORCHRUN_ONLY_TEMPLATE": "1"}, False),
    "local-ranks-filter": (3, ["--local-ranks-filter", "0,2"], ["--local-ranks-filter", "0,2"], {}, False),
    "filter-tee": (2, ["--tee", "3", "--local_ranks_filter", "1"], ["--tee", "3", "--local_ranks_filter", "1"],
                   {}, False),
    "redirects-log-dir": (2, ["--redirects", "3"], ["--redirects", "3"], {}, True),
    "tee-redirects-log-dir": (2, ["--tee", "1", "--redirects", "0:2"], ["--tee", "1", "--redirects", "0:2"], {},
                              True),
}


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=180)


def _tree(log_dir: Path) -> tuple[str, dict[str, bytes]]:
    """The one run directory's name and, under it, every directory ('') and file's bytes; launchpad's
    own log (launchpad.log, launchpad's addition to torchrun's layout) is left out."""
    runs = list(log_dir.iterdir())
    assert len(runs) == 1, runs
    found = {str(p.relative_to(runs[0])): (p.read_bytes() if p.is_file() else b"")
             for p in sorted(runs[0].rglob("*")) if p.name != "launchpad.log"}
    return runs[0].name, found


def _own_lines(pattern: re.Pattern[bytes], data: bytes) -> tuple[bytes, list[bytes]]:
    return pattern.sub(b"", data), [m.group(1) for m in pattern.finditer(data)]


@pytest.mark.parametrize("case", list(CASES))
def test_console_bytes_match_torchrun(tmp_path: Path, case: str) -> None:
    nproc, t_opts, l_opts, extra, with_log_dir = CASES[case]
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "TORCHPASS_LOG_LEVEL",
                         "TORCHPASS_LOG_DIR", "TORCHPASS_LOG_JSON")}
    runs = {}
    for name in ("torchrun", "launchpad"):
        d = tmp_path / name
        (d / "turns").mkdir(parents=True)
        (d / "tmp").mkdir()  # TMPDIR: where either launcher makes its temporary log directories
        env = {**base, **extra, "TMPDIR": str(d / "tmp")}
        if env.pop("TORCHRUN_ONLY_TEMPLATE", None) and name == "torchrun":
            env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = TEMPLATE
        opts = [*(t_opts if name == "torchrun" else l_opts), *(["--log-dir", str(d / "logs")] if with_log_dir else [])]
        common = ["--standalone", "--nproc-per-node", str(nproc), *opts, str(script), str(d / "turns"), str(GAP)]
        argv = [TORCHRUN, *common] if name == "torchrun" else launchpad_argv(*common)
        runs[name] = (argv, env, ROOT)
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(_run, *args) for name, args in runs.items()}
        want, got = futures["torchrun"].result(), futures["launchpad"].result()
    assert want.returncode == 0, want.stderr[-3000:]
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout == want.stdout
    want_err, torchrun_own = _own_lines(TORCHRUN_LOG, want.stderr)
    got_err, launchpad_own = _own_lines(LAUNCHPAD_LOG, got.stderr)
    assert got_err == want_err
    if nproc > 1:
        assert set(torchrun_own) == TORCHRUN_OMP, torchrun_own
        assert len(launchpad_own) == 1 and b'"event": "workers.omp_num_threads"' in launchpad_own[0], launchpad_own
    else:
        assert torchrun_own == launchpad_own == []
    if with_log_dir:
        want_run, want_files = _tree(tmp_path / "torchrun" / "logs")
        got_run, got_files = _tree(tmp_path / "launchpad" / "logs")
        assert got_files == want_files
        run_dir = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}_[a-z0-9_]{8}")
        assert run_dir.fullmatch(want_run) and run_dir.fullmatch(got_run), (want_run, got_run)
        assert (tmp_path / "launchpad" / "logs" / got_run / "launchpad.log").stat().st_size > 0


def test_worker_script_output_is_what_the_comparison_relies_on(tmp_path: Path) -> None:
    """The script really writes what the comparison is about (so equal outputs are not equally empty)."""
    (tmp_path / "turns").mkdir()
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    res = subprocess.run([PYTHON, "-u", str(script), str(tmp_path / "turns"), "0"], capture_output=True,
                         env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(b"rank 0: plain line\n") and b"\r\n" in res.stdout and b"\xff" in res.stdout
    assert res.stdout.endswith(b"rank 0 partial stdout") and res.stderr.endswith(b"rank 0 partial stderr")


def _quiet_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHPASS_LOG_LEVEL", "TORCHPASS_LOG_JSON")}
    return {**env, "TORCHPASS_LOG_DIR": str(tmp_path / "oplogs"), **extra}


def test_launchpads_own_log_goes_to_its_file_and_warnings_to_the_console(tmp_path: Path) -> None:
    res = subprocess.run(launchpad_argv("--standalone", "--no-python", "true"), cwd=ROOT, capture_output=True,
                         env=_quiet_env(tmp_path), timeout=120)
    assert res.returncode == 0 and res.stdout == res.stderr == b"", res.stderr[-3000:]
    (path,) = (tmp_path / "oplogs").iterdir()
    text = path.read_text()
    assert '"event": "rendezvous.hosting"' in text and '"event": "agent.done"' in text
    # TORCHPASS_LOG_LEVEL still sets what the console shows
    res = subprocess.run(launchpad_argv("--standalone", "--no-python", "true"), cwd=ROOT, capture_output=True,
                         env=_quiet_env(tmp_path, TORCHPASS_LOG_LEVEL="info"), timeout=120)
    assert res.returncode == 0 and b'"event": "agent.done"' in res.stderr, res.stderr[-3000:]


def test_a_failed_run_says_where_launchpads_log_is(tmp_path: Path) -> None:
    res = subprocess.run(launchpad_argv("--standalone", "--no-python", "sh", "-c", "exit 3"), cwd=ROOT,
                         capture_output=True, env=_quiet_env(tmp_path), timeout=120)
    assert res.returncode == 3
    (path,) = (tmp_path / "oplogs").iterdir()
    assert f"launchpad's own log is in {path}".encode() in res.stderr, res.stderr
    assert '"event": "agent.round_failed"' in path.read_text()
