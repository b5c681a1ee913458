"""One case on a Ray node: what the runner sends there, what comes back, and the code that runs
it there.

The runner (ci/ray_backend.py) hands `run_case` to Ray as a task asking for the case's GPUs; Ray
starts it on a node with free GPUs and sets CUDA_VISIBLE_DEVICES to the ones it assigned. The
task runs the case's command in its own process group, streams its output to the runner's
`LogSink` (an actor on the runner's node, which writes OUT/logs), ends it at its deadline, and
returns a `CaseRecord` with the exit code and the files the case wrote on the node (its JUnit
file and the harness's result record), since the node's disk is not the runner's.

This module runs inside Ray workers: the standard library, Ray and ci/process_group.py only.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from ci.process_group import end_group

PYTHON = "{python}"  # as in ci.cases, resolved here to this node's interpreter
LOG_FLUSH_S = 0.5
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class NodeSlot:
    """The devices Ray gave one bundle of a case, on one node."""

    node_id: str
    node_ip: str
    gpus: tuple[str, ...]

    @property
    def label(self) -> str:
        """Short and unique: loopback nodes share an address, so the id is part of it."""
        return f"{self.node_ip}/{self.node_id[:6]}"

    def as_json(self) -> dict:
        return {"node_id": self.node_id, "node_ip": self.node_ip, "gpus": list(self.gpus)}


@dataclass(frozen=True)
class CaseSpec:
    """What a node needs to run one attempt of a case."""

    name: str
    argv: tuple[str, ...]
    junit: bool  # append --junitxml=<a file on the node> (pytest commands)
    cwd: str | None  # None: the worker's own (a runtime env working dir)
    deadline: float  # seconds before the process group is ended
    attempt: int = 1
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CaseRecord:
    """What one attempt came to, carried back to the runner."""

    name: str
    slots: tuple[NodeSlot, ...]  # the lead's first, then the other nodes of a multi-node case
    exit_code: int
    timed_out: bool
    started_at: float  # time.time() on the node
    ended_at: float
    junit_xml: str | None
    harness_result: dict | None


def current_slot() -> NodeSlot:
    ctx = ray.get_runtime_context()
    gpus = ctx.get_accelerator_ids().get("GPU", [])
    return NodeSlot(ctx.get_node_id(), ray.util.get_node_ip_address(), tuple(map(str, gpus)))


def hold_bundle(sink, name: str, attempt: int, lead: list) -> None:
    """The Ray task on each other node of a multi-node case: tells the lead which devices Ray
    gave it here, then holds them until the lead's task ends (`lead` wraps its result ref, so
    Ray does not wait for it before starting this)."""
    sink.peer.remote(name, attempt, current_slot())
    ray.wait(lead, fetch_local=False)


def wait_for_peers(sink, name: str, attempt: int, count: int, poll_s: float = 0.05) -> tuple:
    while True:
        peers = ray.get(sink.peers.remote(name, attempt))
        if len(peers) >= count:
            return tuple(peers)
        time.sleep(poll_s)


class LogSink:
    """On the runner's node: appends each case's streamed output to OUT/logs/<case>.log and
    remembers where each case runs, so a case whose node dies can still be placed and tailed."""

    def __init__(self, log_dir: str):
        self.log_dir = Path(log_dir)
        self.placements: dict[str, tuple[NodeSlot, int]] = {}
        self.peer_slots: dict[tuple[str, int], list[NodeSlot]] = {}

    def started(self, name: str, log_name: str, slot: NodeSlot, attempt: int, header: str) -> None:
        self.placements[name] = (slot, attempt)
        with open(self.log_dir / log_name, "w" if attempt == 1 else "a") as log:
            log.write(header)

    def write(self, log_name: str, text: str) -> None:
        with open(self.log_dir / log_name, "a") as log:
            log.write(text)

    def peer(self, name: str, attempt: int, slot: NodeSlot) -> None:
        self.peer_slots.setdefault((name, attempt), []).append(slot)

    def peers(self, name: str, attempt: int) -> list[NodeSlot]:
        return self.peer_slots.get((name, attempt), [])

    def placement(self, name: str) -> tuple[NodeSlot, int] | None:
        """Where the case's latest attempt started, and which attempt that was."""
        return self.placements.get(name)


def _die_with_parent() -> None:
    """In the child: be killed when the Ray worker dies (its raylet gone, its node lost)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class _Pump(threading.Thread):
    """Reads the case's output as it comes; `take` hands over what arrived since last time."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.chunks, self.lock = stream, [], threading.Lock()

    def run(self) -> None:
        for chunk in iter(lambda: os.read(self.stream.fileno(), 65536), b""):
            with self.lock:
                self.chunks.append(chunk)

    def take(self) -> str:
        with self.lock:
            data, self.chunks = b"".join(self.chunks), []
        return data.decode(errors="replace")


def case_env(spec: CaseSpec, slots: tuple[NodeSlot, ...], results_dir: str) -> dict[str, str]:
    env = {**os.environ, **spec.env}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(slots[0].gpus)
    env["MILES_RESULTS_DIR"] = results_dir
    env["MILES_CI_CASE"] = spec.name
    env["MILES_CI_ATTEMPT"] = str(spec.attempt)
    env["MILES_CI_NODE_ID"] = slots[0].node_id
    env["MILES_CI_NODES"] = json.dumps([s.as_json() for s in slots])
    return env


def _stream(proc: subprocess.Popen, sink, log_name: str, deadline: float) -> bool:
    """Forwards output until the process ends or its deadline passes; True when it timed out."""
    pump = _Pump(proc.stdout)
    pump.start()
    end_by = time.monotonic() + deadline
    timed_out = False
    while proc.poll() is None:
        if time.monotonic() > end_by:
            timed_out = True
            end_group(proc)
            break
        try:
            proc.wait(timeout=LOG_FLUSH_S)  # returns as soon as the case ends
        except subprocess.TimeoutExpired:
            pass
        text = pump.take()
        if text:
            sink.write.remote(log_name, text)
    proc.wait()
    pump.join(timeout=5.0)
    # the last write is waited for: the runner reads the log once the record is back
    ray.get(sink.write.remote(log_name, pump.take()))
    return timed_out


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_case(spec: CaseSpec, sink, log_name: str, peers: int = 0) -> CaseRecord:
    """The Ray task: one attempt of one case on the devices Ray assigned to this worker (and,
    for a multi-node case, on those its `peers` hold on the other nodes)."""
    others = wait_for_peers(sink, spec.name, spec.attempt, peers) if peers else ()
    slots = (current_slot(), *others)
    with tempfile.TemporaryDirectory(prefix="miles-ci-case-") as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = [sys.executable if word == PYTHON else word for word in spec.argv]
        argv += [f"--junitxml={junit}"] if spec.junit else []
        env = case_env(spec, slots, tmp)
        where = " + ".join(f"{s.label} GPUs {','.join(s.gpus) or '-'}" for s in slots)
        header = (f"# attempt {spec.attempt} on {where}\n"
                  f"$ CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {' '.join(argv)}\n")
        sink.started.remote(spec.name, log_name, slots[0], spec.attempt, header)  # in order
        started = time.time()
        proc = subprocess.Popen(argv, cwd=spec.cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
        timed_out = _stream(proc, sink, log_name, spec.deadline)
        return CaseRecord(spec.name, slots, proc.returncode, timed_out, started, time.time(),
                          junit.read_text(errors="replace") if junit.exists() else None,
                          _read_json(Path(tmp) / f"{spec.name}.json"))
