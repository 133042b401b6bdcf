"""The control-plane contract: MQTT topic names and the msgpack message schemas, in one place.
Owns building and parsing topics, encoding messages, and strict decoding (size limit, no ext
types, schema version, per-kind required fields and types). It does no networking (mqtt.py does)
and holds no state; every malformed input raises ProtocolError and nothing else."""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from torchpass_common.errors import ProtocolError

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
MAX_DEPTH = 16
TOPIC_ROOT = "torchpass/v1/jobs"

HEARTBEAT, STATE, COMMAND, ACK, EVENT = "heartbeat", "state", "command", "ack", "event"
KINDS = frozenset({HEARTBEAT, STATE, COMMAND, ACK, EVENT})
COMMANDS = frozenset({"recover",  # unplanned: an interrupted survivor donates its state, re-enters, loads
                      "sever",  # unplanned: a peer was decided lost: cut the collectives of stalled workers
                      "pause", "save", "receive", "reform", "resume", "start_joiner", "abort", "exit",
                      "notice",  # a line for the job's own output: why it is not protected right now
                      "health_replay",  # the gpu-degrade drill: sample a recorded failing GPU from now on
                      # transparent (criu) moves: launchpad/transparent.py
                      "preflight", "prepare_restore", "checkpoint", "restore", "discard", "resume_original"})

# Topic leaf <-> message kind: a message is only accepted on the leaf of its kind.
_LEAF_OF_KIND = {HEARTBEAT: "hb", STATE: "state", COMMAND: "cmd", ACK: "ack", EVENT: "events"}
_KIND_OF_LEAF = {leaf: kind for kind, leaf in _LEAF_OF_KIND.items()}

_NONE = type(None)
# Required body fields per kind: name -> accepted types. Extra fields are allowed (a newer
# sender within the same schema version may add some); missing or mistyped ones are not.
_BODY_SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    HEARTBEAT: {"node": (str,), "seq": (int,), "workers": (list,)},
    STATE: {"node": (str,), "online": (bool,)},
    COMMAND: {"cmd": (str,), "migration": (str,), "args": (dict,)},
    ACK: {"command_id": (str,), "cmd": (str,), "migration": (str,), "ok": (bool,),
          "error": (str, _NONE), "result": (dict,)},
    EVENT: {"event": (str,)},
}
_WORKER_SCHEMA: dict[str, tuple[type, ...]] = {"rank": (int,), "step": (int,), "state": (str,)}
_ENVELOPE = {"v": (int,), "kind": (str,), "job": (str,), "gen": (int,), "id": (str,),
             "ts": (float,), "body": (dict,)}
_ID_RE = re.compile(r"[0-9a-f]{32}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.:@=-]{1,128}")


@dataclass(frozen=True)
class Message:
    """One decoded, validated control-plane message. ``body`` holds the kind's fields."""

    v: int
    kind: str
    job: str
    gen: int
    id: str
    ts: float
    body: dict[str, Any]


class Topic(NamedTuple):
    """A parsed topic: ``node`` is None for the job-wide events topic."""

    job: str
    node: str | None
    kind: str


# ---------------------------------------------------------------- topics


def _segment(value: str, what: str) -> str:
    if not isinstance(value, str) or not _SEGMENT_RE.fullmatch(value):
        raise ProtocolError(f"invalid {what} name {value!r} for an MQTT topic",
                            hint="use 1-128 characters from letters, digits and _ . : @ = -")
    return value


def _node_topic(job: str, node: str, kind: str) -> str:
    return f"{TOPIC_ROOT}/{_segment(job, 'job')}/nodes/{_segment(node, 'node')}/{_LEAF_OF_KIND[kind]}"


def hb_topic(job: str, node: str) -> str:
    """launchpad -> orchestrator heartbeats of one node."""
    return _node_topic(job, node, HEARTBEAT)


def state_topic(job: str, node: str) -> str:
    """Retained online state of one node's launchpad; its Last Will publishes offline here."""
    return _node_topic(job, node, STATE)


def cmd_topic(job: str, node: str) -> str:
    """orchestrator -> launchpad commands for one node."""
    return _node_topic(job, node, COMMAND)


def ack_topic(job: str, node: str) -> str:
    """launchpad -> orchestrator acknowledgements of commands."""
    return _node_topic(job, node, ACK)


def events_topic(job: str) -> str:
    """The job's migration timeline, for tools."""
    return f"{TOPIC_ROOT}/{_segment(job, 'job')}/events"


def nodes_filter(kind: str, job: str | None = None) -> str:
    """Subscription filter for one per-node kind across all nodes of ``job`` (all jobs if None)."""
    if kind not in _LEAF_OF_KIND or kind == EVENT:
        raise ProtocolError(f"no per-node topic for message kind {kind!r}",
                            hint=f"use one of {sorted(set(_LEAF_OF_KIND) - {EVENT})}")
    job_part = "+" if job is None else _segment(job, "job")
    return f"{TOPIC_ROOT}/{job_part}/nodes/+/{_LEAF_OF_KIND[kind]}"


def events_filter(job: str | None = None) -> str:
    """Subscription filter for the events of ``job`` (all jobs if None)."""
    return f"{TOPIC_ROOT}/{'+' if job is None else _segment(job, 'job')}/events"


def job_filter(job: str) -> str:
    """Subscription filter for everything under one job's subtree."""
    return f"{TOPIC_ROOT}/{_segment(job, 'job')}/#"


def parse_topic(topic: str) -> Topic:
    """Split a concrete TorchPass topic into job, node and message kind."""
    prefix = TOPIC_ROOT + "/"
    parts = topic[len(prefix):].split("/") if topic.startswith(prefix) else []
    if len(parts) == 2 and parts[1] == "events":
        job, node, leaf = parts[0], None, parts[1]
    elif len(parts) == 4 and parts[1] == "nodes" and parts[3] in _KIND_OF_LEAF and parts[3] != "events":
        job, node, leaf = parts[0], parts[2], parts[3]
    else:
        raise ProtocolError(f"topic {topic!r} is not a TorchPass v1 topic",
                            hint=f"expected {TOPIC_ROOT}/<job>/nodes/<node>/<hb|state|cmd|ack> "
                                 f"or {TOPIC_ROOT}/<job>/events")
    _segment(job, "job")
    if node is not None:
        _segment(node, "node")
    return Topic(job, node, _KIND_OF_LEAF[leaf])


# ---------------------------------------------------------------- messages


def new_id() -> str:
    """A fresh message id (uuid4 hex)."""
    return uuid.uuid4().hex


def encode(kind: str, *, job: str, gen: int, body: dict[str, Any]) -> bytes:
    """Build and serialise a message. The result is validated exactly as ``decode`` would, so
    a sender finds its own schema mistakes at once instead of receivers dropping them."""
    env = {"v": SCHEMA_VERSION, "kind": kind, "job": job, "gen": gen, "id": new_id(),
           "ts": time.time(), "body": body}
    _validate(env)
    payload = msgpack.packb(env, use_bin_type=True)
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{kind} message of {len(payload)} bytes exceeds the limit of "
                            f"{MAX_MESSAGE_BYTES} bytes", job=job, gen=gen,
                            hint="send bulk data through the wormhole, not the control plane")
    return payload


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def decode(payload: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Strictly decode and validate one message; raise ProtocolError on any defect."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise ProtocolError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes} bytes",
                            hint="the sender must keep control messages small")
    try:
        env = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a mix of ValueError subclasses and others
        raise ProtocolError(f"payload is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    _validate(env)
    return Message(**env)


def _validate(env: Any) -> None:
    if not isinstance(env, dict):
        raise ProtocolError(f"message must be a msgpack map, got {type(env).__name__}")
    _check_plain(env, "message", 0)
    if env.get("v") != SCHEMA_VERSION and isinstance(env.get("v"), int):
        raise ProtocolError(f"unsupported schema version {env['v']} (this side speaks {SCHEMA_VERSION})",
                            job=env.get("job"), hint="run the same TorchPass release on all nodes")
    _check_fields(env, _ENVELOPE, "message")
    unknown = sorted(set(env) - set(_ENVELOPE))
    if unknown:
        raise ProtocolError(f"unknown envelope field(s) {unknown}", job=env["job"], gen=env["gen"])
    kind, job, gen = env["kind"], env["job"], env["gen"]
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}", job=job, hint=f"known: {sorted(KINDS)}")
    _segment(job, "job")
    if gen < 0:
        raise ProtocolError(f"generation must be >= 0, got {gen}", job=job)
    if not _ID_RE.fullmatch(env["id"]):
        raise ProtocolError(f"message id {env['id'][:40]!r} is not 32 lowercase hex digits", job=job)
    if not math.isfinite(env["ts"]):
        raise ProtocolError("timestamp is not a finite number", job=job)
    body = env["body"]
    _check_fields(body, _BODY_SCHEMA[kind], f"{kind} body", job=job, gen=gen)
    if kind == COMMAND and body["cmd"] not in COMMANDS:
        raise ProtocolError(f"unknown command {body['cmd']!r}", job=job, gen=gen,
                            hint=f"known: {sorted(COMMANDS)}")
    if kind == HEARTBEAT:
        for i, worker in enumerate(body["workers"]):
            if not isinstance(worker, dict):
                raise ProtocolError(f"heartbeat workers[{i}] must be a map", job=job, gen=gen)
            _check_fields(worker, _WORKER_SCHEMA, f"heartbeat workers[{i}]", job=job, gen=gen)


def _check_fields(data: dict[str, Any], schema: dict[str, tuple[type, ...]], what: str,
                  **where: Any) -> None:
    for name, types in schema.items():
        if name not in data:
            raise ProtocolError(f"{what} lacks required field {name!r}", **where)
        value = data[name]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            wanted = " or ".join("nil" if t is _NONE else t.__name__ for t in types)
            raise ProtocolError(f"{what} field {name!r} must be {wanted}, got {type(value).__name__}",
                                **where)


def _check_plain(value: Any, path: str, depth: int) -> None:
    """Only plain msgpack types (nil, bool, int, float, str, bin, array, map with str keys)."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"message nests deeper than {MAX_DEPTH} levels at {path}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(f"map key at {path} must be a string, got {type(key).__name__}")
            _check_plain(item, f"{path}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(item, f"{path}[{i}]", depth + 1)
    elif not isinstance(value, str | int | float | bytes | _NONE):
        raise ProtocolError(f"value of type {type(value).__name__} at {path} is not allowed")
