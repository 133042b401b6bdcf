"""The ``launchpad`` console script: torchrun's command line (both dash and underscore spellings,
same defaults and meanings) plus TorchPass's own --job/--node/--config, turned into a LaunchSpec
and handed to the agent. In a ``--torchpass`` Slurm job all three come from the job itself
(SLURM_JOB_ID, SLURMD_NODENAME, and TORCHPASS_CONFIG set by the SPANK plugin), so the user's
unchanged ``srun torchrun ...`` joins the control plane. Exit code: 0 when every worker succeeded, the failed worker's otherwise."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import uuid

import click

from launchpad import spec as specmod
from torchpass_common import agent_channel, log
from torchpass_common import config as configmod
from torchpass_common.errors import ConfigError, TorchPassError

CONSOLE_LOG_LEVEL = "warning"  # launchpad's own log on the console, like torchrun's; all of it: own_log_file


def _opt(*names: str, **kw: object):  # noqa: ANN202 - click decorator factory
    """An option under torchrun's dash name plus its underscore twin (``--nproc-per-node``,
    ``--nproc_per_node``), stored under the underscore name."""
    dash = [n for n in names if n.startswith("--")]
    twins = [n.replace("-", "_").replace("__", "--", 1) for n in dash if "-" in n[2:]]
    dest = dash[0][2:].replace("-", "_")
    return click.option(*names, *twins, dest, **kw)


@click.command(context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]})
@_opt("--nnodes", default=None, help="Number of nodes, N or MIN:MAX (default 1, or the Slurm step's nodes).")
@_opt("--nproc-per-node", default="1", help="Workers per node: a number, cpu, gpu or auto.")
@_opt("--rdzv-backend", default="static", help="static (fixed node ranks) or c10d (ranks assigned on join).")
@_opt("--rdzv-endpoint", default="", help="HOST[:PORT] of the rendezvous store.")
@_opt("--rdzv-id", default=None, help="Run id shared by all nodes (default: SLURM_JOB_ID or 'none').")
@_opt("--rdzv-conf", default="", help="key=value,... : join_timeout, last_call_timeout.")
@click.option("--standalone", is_flag=True, help="Single node, private rendezvous on a free local port.")
@_opt("--max-restarts", default=0, type=int, help="Restart all workers this many times after a failure.")
@_opt("--monitor-interval", default=0.1, type=float, help="Seconds between worker health checks.")
@_opt("--start-method", default="spawn", type=click.Choice(["spawn", "fork", "forkserver"]),
      help="Accepted for torchrun compatibility; workers are always fresh interpreters.")
@click.option("--role", default="default", help="Worker role name (ROLE_NAME).")
@click.option("-m", "--module", is_flag=True, help="Run the entrypoint as a Python module (python -m).")
@_opt("--no-python", is_flag=True, help="Execute the entrypoint directly, not through Python.")
@_opt("--run-path", is_flag=True, help="Accepted for torchrun compatibility (scripts always run as __main__).")
@_opt("--log-dir", default=None, help="Keep each worker's stdout/stderr under this directory.")
@click.option("--redirects", "-r", default="0", help="Send worker output to log files only: 0-3 or LR:MASK,...")
@click.option("--tee", "-t", default="0", help="Send worker output to log files and the console: 0-3 or LR:MASK,...")
@_opt("--local-ranks-filter", default="", help="Show only these local ranks' output on the console: 0,1,...")
@_opt("--log-line-prefix-template", default=lambda: os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
      help="Prefix of teed console lines, with ${role_name}, ${rank}, ${local_rank} "
           "(default: env TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else [${role_name}${local_rank}]:).")
@_opt("--node-rank", default=None, type=int, help="This node's rank (static rendezvous).")
@_opt("--master-addr", default=None, help="Host of the rendezvous store for the static backend.")
@_opt("--master-port", default=None, type=int, help="Port of the rendezvous store for the static backend.")
@_opt("--grace-period", default=15.0, type=float, help="Seconds between SIGTERM and SIGKILL when stopping workers.")
@click.option("--job", default=lambda: specmod.torchpass_job(os.environ),
              help="TorchPass job id (control plane); default: the Slurm job id in a --torchpass job.")
@click.option("--node", default=lambda: os.environ.get("SLURMD_NODENAME"),
              help="This node's name (control plane); default: Slurm's name for it, else the hostname.")
@click.option("--as-tasks", is_flag=True,
              help="Each worker is a task of a srun python step (the node's other tasks hand themselves over); "
                   "set by TorchPass's start-up hook, not by hand.")
@click.option("--config", "config_path", default=None, help="TorchPass config file (broker, timeouts).")
@click.option("--broker", default=lambda: os.environ.get("TORCHPASS_BROKER"),
              help="MQTT broker HOST[:PORT], overriding [broker] of the config (env TORCHPASS_BROKER).")
@click.argument("entrypoint")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def main(**opts: object) -> None:
    """Run ENTRYPOINT on every worker of this node, like torchrun, under TorchPass supervision."""
    try:
        log.setup(CONSOLE_LOG_LEVEL)  # the console only, until the run's log file is known
        spec = build_spec(opts, os.environ)
        if spec.as_tasks:  # a srun python task's stderr shows torch's warnings of its rank, none of launchpad's store
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        config = with_broker(configmod.load(opts["config_path"]), opts["broker"])  # type: ignore[arg-type]
        config.timeouts.validate()
        from launchpad.output import own_log_file  # deferred: --help stays fast

        log_file = own_log_file(spec, os.environ)
    except TorchPassError as exc:
        click.echo(f"launchpad: {exc}", err=True)
        sys.exit(2)
    log.setup(CONSOLE_LOG_LEVEL, file=log_file)
    os.environ[log.ENV_FILE] = str(log_file)  # the workers' TorchPass library logs there too
    log.get(node=spec.node, run=spec.run_id).info("launchpad.started", argv=sys.argv, log_file=str(log_file))
    joining = agent_channel.ENV_JOIN_PLAN in os.environ  # a spare's launchpad joining mid-job: nothing torchrun says
    slurm = specmod.SlurmHints.from_env(os.environ)
    if (why := specmod.hot_spares_ignored(slurm)) and not joining:
        log.get().warning("launchpad.hot_spares_ignored", spares=slurm.spares, why=why,
                          hint="every node of the step trains and none is kept as a hot spare")
    if joining:
        _check_workdir(spec.node, spec.nproc_per_node, log_file)
    if "OMP_NUM_THREADS" not in os.environ and spec.nproc_per_node > 1 and not joining and not spec.as_tasks:  # torchrun warns the same
        log.get().warning("workers.omp_num_threads", value=1, nproc_per_node=spec.nproc_per_node,
                          hint="OMP_NUM_THREADS=1 for each worker by default, so the workers do not "
                               "overload the node; set it yourself to tune performance")
    from launchpad.agent import run  # deferred: --help stays fast

    code = run(spec, config)
    if code:
        click.echo(f"launchpad: launchpad's own log is in {log_file}", err=True)
    sys.exit(code)


def _check_workdir(node: str, nproc: int, log_file: object) -> None:
    """A joining launchpad runs in the job's working directory (the join plan's cwd) or not at all:
    srun starts a task whose --chdir is missing on the node in /tmp, where the script's relative
    paths would name other files. Exits EXIT_NO_WORKDIR, which torchpassd reports."""
    from launchpad.group import join_plan  # deferred: --help stays fast

    try:
        plan = join_plan(nproc)
    except TorchPassError:
        return  # a malformed plan is reported where the workers start
    wanted = (plan or {}).get("cwd") or ""
    if wanted and os.path.realpath(os.getcwd()) != os.path.realpath(wanted):
        log.get(node=node).error("launchpad.no_workdir", wanted=wanted, cwd=os.getcwd())
        click.echo(f"launchpad: the job's working directory {wanted} does not exist on {node} (or is not "
                   f"readable there); this node cannot take over the job's ranks. Log: {log_file}", err=True)
        sys.exit(agent_channel.EXIT_NO_WORKDIR)


def _output_args(opts: dict) -> tuple[str, ...]:
    """The output options this launchpad was given (--log-dir, --redirects, --tee,
    --local-ranks-filter, --log-line-prefix-template), as arguments: a spare's launchpad that takes
    over this node's ranks is started with the same, so their output goes on as before."""
    masks = {name: str(opts.get(key) or "0") for name, key in (("--redirects", "redirects"), ("--tee", "tee"))}
    given = {"--log-dir": opts.get("log_dir"), **{n: m for n, m in masks.items() if m != "0"},
             "--local-ranks-filter": opts.get("local_ranks_filter"),
             "--log-line-prefix-template": opts.get("log_line_prefix_template")}
    return tuple(a for name, value in given.items() if value for a in (name, str(value)))


def build_spec(opts: dict, env: os._Environ[str] | dict[str, str]) -> specmod.LaunchSpec:
    """Resolve torchrun's options, their defaults and the Slurm environment into a LaunchSpec."""
    slurm = specmod.SlurmHints.from_env(env)
    nproc = specmod.parse_nproc(str(opts["nproc_per_node"]))
    rdzv_conf = _parse_rdzv_conf(str(opts["rdzv_conf"]))
    common = dict(
        entrypoint=str(opts["entrypoint"]), args=tuple(opts["args"]),  # type: ignore[arg-type]
        nproc_per_node=nproc, max_restarts=int(opts["max_restarts"]),  # type: ignore[arg-type]
        module=bool(opts["module"]), no_python=bool(opts["no_python"]), log_dir=opts["log_dir"],
        redirects=specmod.parse_std_mask(str(opts["redirects"]), nproc),
        tee=specmod.parse_std_mask(str(opts["tee"]), nproc), role=str(opts["role"]),
        console_ranks=specmod.parse_ranks_filter(str(opts["local_ranks_filter"])),
        log_line_prefix_template=opts.get("log_line_prefix_template") or None,
        output_args=_output_args(opts), as_tasks=bool(opts["as_tasks"]),
        first_task_env=dict(env) if opts["as_tasks"] else {},
        monitor_interval=float(opts["monitor_interval"]),  # type: ignore[arg-type]
        grace_period=float(opts["grace_period"]), job=opts["job"], node=opts["node"] or socket.gethostname(),  # type: ignore[arg-type]
        **rdzv_conf,
    )
    if opts["module"] and opts["no_python"]:
        raise ConfigError("--module and --no-python cannot be used together")
    if opts["standalone"]:
        return specmod.LaunchSpec(**common, node_rank=0, rdzv_backend="c10d", rdzv_host="127.0.0.1",
                                  rdzv_port=0, run_id=str(uuid.uuid4()))  # type: ignore[arg-type]
    if opts["nnodes"]:
        lo, hi = specmod.parse_nnodes(str(opts["nnodes"]))
    else:
        lo = hi = slurm.nnodes or 1
    hot = False
    if agent_channel.ENV_JOIN_PLAN not in env:  # a joiner takes a lost node's place: never a spare
        lo, hi, hot = specmod.split_hot_spares(slurm, lo, hi)
    backend = str(opts["rdzv_backend"])
    if backend not in ("static", "c10d"):
        raise ConfigError(f"--rdzv-backend {backend!r} is not supported", hint="use static or c10d")
    if backend == "static" and lo != hi:
        raise ConfigError(f"--nnodes {lo}:{hi} needs --rdzv-backend=c10d (static needs a fixed size)")
    node_rank = opts["node_rank"]
    if node_rank is None and backend == "static":
        node_rank = slurm.node_rank if slurm.node_rank is not None else 0
    if node_rank is not None and not hot and not 0 <= node_rank < hi:  # type: ignore[operator]
        raise ConfigError(f"--node-rank {node_rank} is outside 0..{hi - 1} for --nnodes {hi}")
    default_host = opts["master_addr"] or (slurm.first_host if hi > 1 else None) or specmod.DEFAULT_MASTER_ADDR
    default_port = opts["master_port"] or specmod.DEFAULT_MASTER_PORT
    if opts["rdzv_endpoint"]:
        host, port = specmod.parse_endpoint(str(opts["rdzv_endpoint"]), int(default_port))  # type: ignore[arg-type]
    else:
        host, port = str(default_host), int(default_port)  # type: ignore[arg-type]
    run_id = opts["rdzv_id"] or slurm.job_id or "none"
    return specmod.LaunchSpec(**common, nnodes_min=lo, nnodes_max=hi, node_rank=node_rank,  # type: ignore[arg-type]
                              rdzv_backend=backend, rdzv_host=host, rdzv_port=port, run_id=str(run_id),
                              hot_spare=hot)


def with_broker(config: configmod.Config, endpoint: str | None) -> configmod.Config:
    """``config`` with the broker address replaced by ``endpoint`` (HOST[:PORT]) when given."""
    if not endpoint:
        return config
    host, port = specmod.parse_endpoint(endpoint, config.broker.port)
    return dataclasses.replace(config, broker=dataclasses.replace(config.broker, host=host, port=port))


def _parse_rdzv_conf(text: str) -> dict[str, float]:
    names = {"join_timeout": "join_timeout", "last_call_timeout": "last_call"}
    result: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in names:
            continue  # torchrun passes backend-specific keys (e.g. is_host) through; none concern us
        try:
            result[names[key]] = float(value)
        except ValueError as exc:
            raise ConfigError(f"--rdzv-conf {key}={value!r} is not a number of seconds") from exc
    return result
