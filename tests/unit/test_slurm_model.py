"""Parsing what Slurm prints (sinfo/squeue --json as measured on 22.05, the 24.11 shape, and
`scontrol -o`) into nodes, jobs and reservations, and deciding node health and TorchPass jobs."""

from slurm_plugin import openapi
from slurm_plugin.backends.commands import parse_oneliner

# Captured from `sinfo --json` / `squeue --json` on the 22.05 dev cluster (fields trimmed).
DRAINING = {"name": "n3", "state": "mixed", "state_flags": ["DRAIN"], "reason": "disk failing",
            "reason_changed_at": 1796223073, "reason_set_by_user": "root", "address": "10.77.2.13",
            "alloc_cpus": 1}
SPARE = {"name": "n5", "state": "idle", "state_flags": ["RESERVED"], "reason": "", "reason_changed_at": 0,
         "reason_set_by_user": None, "address": "10.77.2.15", "alloc_cpus": 0}
JOB = {"job_id": 14, "name": "wrap", "user_name": "root", "job_state": "RUNNING", "nodes": "n[2-3]",
       "batch_host": "n2", "partition": "main", "comment": "torchpass:mode=aware,spares=0",
       "admin_comment": "", "resize_time": 0, "start_time": 1796223000}


def test_draining_node_22_05() -> None:
    node = openapi.node(DRAINING)
    assert (node.state, node.draining, node.drained, node.healthy) == ("mixed", True, False, False)
    assert (node.reason, node.reason_by, node.reason_time) == ("disk failing", "root", 1796223073)


def test_reserved_idle_spare_is_healthy() -> None:
    node = openapi.node(SPARE)
    assert node.healthy and node.idle and node.reason_by == ""


def test_node_24_11_shape() -> None:
    node = openapi.node({"name": "n1", "state": ["IDLE", "DRAIN"], "alloc_cpus": 2,
                         "reason_changed_at": {"set": True, "infinite": False, "number": 17}})
    assert node.state == "mixed" and node.draining and node.reason_time == 17
    down = openapi.node({"name": "n2", "state": ["DOWN", "NOT_RESPONDING"]})
    assert down.down and down.not_responding and not down.healthy


def test_torchpass_job_from_comment_marker() -> None:
    job = openapi.job(JOB)
    assert job.nodes == ("n2", "n3") and job.active
    assert job.torchpass is not None and (job.torchpass.mode, job.torchpass.spares) == ("aware", 0)
    user_comment = openapi.job(dict(JOB, comment="torchpass:mode=auto,spares=2 nightly run"))
    assert user_comment.torchpass.spares == 2
    assert openapi.job(dict(JOB, comment="just a job")).torchpass is None


def test_24_11_job_state_list() -> None:
    assert openapi.job(dict(JOB, job_state=["RUNNING", "RESIZING"])).state == "RUNNING"


def test_job_start_time_both_shapes() -> None:
    """The start time (job credentials are bound to it): a number (22.05) or {"set", "number"} (24.11)."""
    assert openapi.job(JOB).start_time == 1796223000
    assert openapi.job(dict(JOB, start_time={"set": True, "infinite": False, "number": 1796223001})).start_time == 1796223001


def test_reservation_activity_follows_its_times() -> None:
    raw = {"name": "torchpass_spares", "node_list": "n[4-5]", "start_time": 100, "end_time": 200,
           "users": "root,alice"}
    assert openapi.reservation(raw, now=150).active
    assert openapi.reservation(raw, now=150).users == ("root", "alice")
    assert not openapi.reservation(raw, now=250).active
    assert openapi.reservation(raw, now=150).nodes == ("n4", "n5")


def test_errors_array() -> None:
    assert openapi.errors({"errors": [{"error": "Invalid user", "error_number": 1}]}) == ["Invalid user"]
    assert openapi.errors({"errors": []}) == []


def test_scontrol_oneliner_keeps_values_with_spaces() -> None:
    line = ("ReservationName=torchpass_spares StartTime=2026-12-02T14:50:05 Nodes=n5 NodeCnt=1 "
            "Flags=IGNORE_JOBS,SPEC_NODES TRES=cpu=2 Users=root State=ACTIVE")
    rec = parse_oneliner(line)
    assert rec["Nodes"] == "n5" and rec["State"] == "ACTIVE" and rec["TRES"] == "cpu=2"
    assert parse_oneliner("NodeName=n2 Reason=disk failing [root@2026-12-02T14:04:44]")["Reason"] == \
        "disk failing [root@2026-12-02T14:04:44]"
