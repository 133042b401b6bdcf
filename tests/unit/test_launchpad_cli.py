"""launchpad's torchrun command line: both spellings, torchrun's defaults, the Slurm-derived
node rank / node count / rendezvous host, and clear usage errors (exit code 2)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from launchpad import cli, spec
from torchpass_common import config
from torchpass_common.errors import ConfigError


def build(*argv: str, env: dict[str, str] | None = None) -> spec.LaunchSpec:
    params = cli.main.make_context("launchpad", list(argv)).params
    return cli.build_spec(params, env or {})


def test_dash_and_underscore_spellings_mean_the_same() -> None:
    dash = build("--nnodes=2", "--nproc-per-node=3", "--node-rank=1", "--master-addr=h0", "--master-port=1234",
                 "--max-restarts=2", "train.py", "--lr", "0.1")
    under = build("--nnodes", "2", "--nproc_per_node", "3", "--node_rank", "1", "--master_addr", "h0",
                  "--master_port", "1234", "--max_restarts", "2", "train.py", "--lr", "0.1")
    assert dash == under
    assert (dash.nproc_per_node, dash.node_rank, dash.rdzv_host, dash.rdzv_port) == (3, 1, "h0", 1234)
    assert dash.args == ("--lr", "0.1")  # options after the script belong to the script


def test_torchrun_defaults() -> None:
    s = build("train.py")
    assert (s.nnodes_min, s.nnodes_max, s.nproc_per_node, s.node_rank) == (1, 1, 1, 0)
    assert (s.rdzv_backend, s.rdzv_host, s.rdzv_port, s.run_id) == ("static", "127.0.0.1", 29500, "none")


def test_rdzv_endpoint_and_elastic_range() -> None:
    s = build("--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=[::1]:777", "--rdzv-id=j9",
              "--rdzv-conf=join_timeout=5,last_call_timeout=0.5,is_host=1", "train.py")
    assert (s.nnodes_min, s.nnodes_max, s.node_rank) == (1, 4, None)
    assert (s.rdzv_host, s.rdzv_port, s.run_id, s.join_timeout, s.last_call) == ("::1", 777, "j9", 5.0, 0.5)


def test_standalone_uses_a_private_store() -> None:
    s = build("--standalone", "--nnodes=4", "train.py")
    assert (s.nnodes_max, s.node_rank, s.rdzv_host, s.rdzv_port) == (1, 0, "127.0.0.1", 0)


def test_slurm_environment_gives_node_rank_count_and_host() -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "3", "SLURM_NTASKS": "3", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[07-09]"}
    s = build("--nproc-per-node=2", "train.py", env=env)
    assert (s.node_rank, s.nnodes_max, s.rdzv_host, s.run_id) == (2, 3, "gpu07", "42")
    # explicit options win over the environment
    s = build("--nnodes=3", "--node-rank=0", "--master-addr=10.0.0.1", "--rdzv-id=x", "train.py", env=env)
    assert (s.node_rank, s.rdzv_host, s.run_id) == (0, "10.0.0.1", "x")


def test_slurm_with_several_tasks_per_node_does_not_guess_the_node_rank() -> None:
    env = {"SLURM_NNODES": "2", "SLURM_NTASKS": "8", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n1,n2"}
    assert spec.SlurmHints.from_env(env).node_rank is None


@pytest.mark.parametrize(("nodelist", "first"), [("n1", "n1"), ("n[3-5,7],m1", "n3"), ("a-b1,c", "a-b1"),
                                                  ("rack2-[011-012]", "rack2-011")])
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert spec.first_slurm_host(nodelist) == first


def test_redirect_tee_and_console_filter() -> None:
    s = build("--nproc-per-node=3", "--redirects=0:1,2:3", "--tee", "2", "--local_ranks_filter=0,2", "train.py")
    assert dict(s.redirects) == {0: 1, 2: 3}
    assert dict(s.tee) == {0: 2, 1: 2, 2: 2}
    assert s.console_ranks == {0, 2}
    assert build("train.py").console_ranks is None


@pytest.mark.parametrize("argv", [
    ["--nnodes=0", "t.py"], ["--nnodes=3:2", "--rdzv-backend=c10d", "t.py"], ["--nnodes=1:2", "t.py"],
    ["--nnodes=2", "--node-rank=2", "t.py"], ["--nproc-per-node=lots", "t.py"], ["--redirects=5", "t.py"],
    ["--rdzv-backend=etcd", "t.py"], ["-m", "--no-python", "t"], ["--local-ranks-filter=a", "t.py"],
])
def test_bad_options_are_config_errors(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        build(*argv)


def test_usage_errors_exit_2_with_the_reason() -> None:
    res = CliRunner().invoke(cli.main, ["--nnodes=2:1", "train.py"])
    assert res.exit_code == 2
    assert "MIN <= MAX" in res.output
    assert CliRunner().invoke(cli.main, ["--no-such-option", "t.py"]).exit_code == 2


def test_broker_option_overrides_the_config() -> None:
    base = config.parse("[broker]\nhost = 'mq.example'\nport = 1884\nkeepalive = 3\n")
    assert cli.with_broker(base, None) == base
    b = cli.with_broker(base, "10.77.4.1:20483").broker
    assert (b.host, b.port, b.keepalive) == ("10.77.4.1", 20483, 3)
    assert cli.with_broker(base, "ctl").broker.port == 1884


def test_a_torchpass_task_reports_to_its_slurm_job_and_a_plain_one_to_none() -> None:
    slurm = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n3"}
    assert spec.torchpass_job({**slurm, "TORCHPASS": "aware"}) == "42"  # the SPANK plugin marked the task
    assert spec.torchpass_job(slurm) is None  # launchpad run by hand inside a job without --torchpass
    assert spec.torchpass_job({"TORCHPASS": "auto"}) is None  # not under Slurm


def test_torchpass_spares_make_the_steps_last_nodes_hot_spares() -> None:
    """``sbatch -N4 --torchpass-spares=1``: the step's last node (SLURM_NODEID 3) holds warm standbys
    instead of ranks; ``--nnodes $SLURM_NNODES`` (4) counts it, so the job trains on 3 nodes, as
    with ``--nnodes 3``. A joiner, a job without TorchPass, or spares leaving no node change nothing."""
    def env(node: int, **more: str) -> dict[str, str]:
        return {"SLURM_JOB_ID": "9", "SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_NODEID": str(node),
                "SLURM_JOB_NODELIST": "n[1-4]", "TORCHPASS": "aware", "TORCHPASS_SPARES": "1", **more}

    def place(*argv: str, **e: str) -> tuple[int, int, bool]:
        s = build(*argv, "train.py", env=env(int(e.pop("node")), **e))
        return s.nnodes_min, s.nnodes_max, s.hot_spare

    assert place("--nnodes=4", node="3") == (3, 3, True)
    assert place("--nnodes=4", node="1") == (3, 3, False)
    assert place("--nnodes=3", node="3") == (3, 3, True)
    assert place("--nnodes=1:4", "--rdzv-backend=c10d", node="3") == (1, 3, True)
    assert place("--nnodes=4", node="3", TORCHPASS="") == (4, 4, False)  # not a TorchPass job
    assert place("--nnodes=4", node="3", TORCHPASS_SPARES="4") == (4, 4, False)  # no node would train
    assert place("--nnodes=4", node="3", TORCHPASS_SPARES="x") == (4, 4, False)
    joiner = env(0, TORCHPASS_JOIN_PLAN="{}")  # a spare started by torchpassd to take a lost node's ranks
    assert build("--nnodes=1", "--nproc-per-node=2", "train.py", env=joiner).hot_spare is False


def test_hot_spares_that_cannot_be_honoured_say_why() -> None:
    def why(**env: str) -> str:
        base = {"SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "TORCHPASS": "aware",
                "TORCHPASS_SPARES": "1"}
        return spec.hot_spares_ignored(spec.SlurmHints.from_env({**base, **env}))

    assert why() == ""
    assert "no node would be left to train" in why(TORCHPASS_SPARES="2")
    assert "one task a node" in why(SLURM_NTASKS="4")
    assert why(TORCHPASS_SPARES="0") == ""
