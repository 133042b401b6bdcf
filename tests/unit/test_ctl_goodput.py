"""``torchpassctl goodput`` on a journal with recorded migrations: the table, --json and the PNG
chart, and clear errors for a missing journal."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from torchpassd.ctl import main
from torchpassd.journal import RUNNING, SUCCEEDED, Journal

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "contrib" / "goodput" / "cluster.toml"


def _journal(path: Path) -> None:
    with Journal(path) as j:
        for job, nodes, pause in (("11", 4, 1.5), ("12", 8, 2.5)):
            j.upsert_job(job, user="u", mode="aware", state="RUNNING", gen=1, nodes=[f"n{i}" for i in range(nodes)])
            mid = j.start_migration(job, mode="planned-aware", source="n1", reason="drain", gen=1)
            j.record_transition(mid, "resumed", RUNNING, {"pause_s": pause})
            j.record_transition(mid, "released", SUCCEEDED, {"pause_s": pause})
        j.start_migration("12", mode="planned-aware", source="n2", reason="drain", gen=2)


def test_goodput_writes_a_table_and_a_png(tmp_path: Path) -> None:
    _journal(tmp_path / "journal.sqlite")
    png = tmp_path / "g.png"
    res = CliRunner().invoke(main, ["goodput", "--cluster", str(CLUSTER), "--journal", str(tmp_path / "journal.sqlite"),
                                    "--png", str(png)])
    assert res.exit_code == 0, res.output
    assert "observed (journal)" in res.output and "projected per year" in res.output
    assert "not counted: 1 running" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_goodput_json_counts_the_migrations(tmp_path: Path) -> None:
    _journal(tmp_path / "journal.sqlite")
    res = CliRunner().invoke(main, ["goodput", "--cluster", str(CLUSTER), "--journal", str(tmp_path / "journal.sqlite"),
                                    "--png", str(tmp_path / "g.png"), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    observed = rep["lines"][0]
    assert observed["failures"] == 2 and rep["mean_pause_s"] == 2.0
    # example description: 300 s restart + 600/2 s, 4 GPUs per node; jobs of 4 and 8 nodes
    assert observed["gpu_hours_checkpoint_restart"] == (16 + 32) * 600 / 3600
    assert rep["statuses"] == {"succeeded": 2, "running": 1}


def test_goodput_without_a_journal_says_where_it_looked(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["goodput", "--cluster", str(CLUSTER), "--journal", str(tmp_path / "none.sqlite"),
                                    "--png", str(tmp_path / "g.png")])
    assert res.exit_code == 1 and "no journal at" in res.output
