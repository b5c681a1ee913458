"""Runs a suite's cases on a Ray cluster of GPU nodes: Ray places them, this collects results.

Each case becomes one Ray task (`ci.ray_case.run_case`) asking for its GPU count; a multi-node
case gets a placement group with one bundle per node (the case's `placement` strategy), its
task in bundle 0 and a `hold_bundle` task in each other bundle, so every node's devices are
held while the case runs. Ray assigns the devices (CUDA_VISIBLE_DEVICES).

Cases are handed to Ray in the packer's priority order, each when it fits the cluster's free
GPUs node by node (ci/cluster_dispatch.py says why and how).

A case whose node dies under it is "node lost": an error with its log tail, and with
`retry_lost` it is submitted again (Ray places it on a node that is still alive).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import ray
from ray.job_config import JobConfig
from ray.exceptions import (ActorDiedError, LocalRayletDiedError, NodeDiedError, RayError,
                            WorkerCrashedError)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                            PlacementGroupSchedulingStrategy)

from ci.cases import Case
from ci.cluster_dispatch import ClusterDispatcher, GpuNode
from ci.gpu_shares import ray_gpu_request
from ci.scheduler import Plan
from ci.ray_case import CaseRecord, CaseSpec, LogSink, hold_bundle, run_case
from ci.results import NODE_LOST, CaseResult, tail
from ci.runner import (Ended, RunSettings, case_argv, case_deadline, conclude, safe_filename,
                       unschedulable_result, wants_junit)

ADDRESS_ENV = "MILES_CI_RAY_ADDRESS"
# errors that mean the process running the case is gone; whether its node went with it is
# asked of the cluster, for up to NODE_DEATH_WAIT seconds (health checks take a while)
WORKER_GONE = (NodeDiedError, WorkerCrashedError, ActorDiedError, LocalRayletDiedError)
NODE_DEATH_WAIT = 60.0
HOLDER_GRACE_S = 5.0

# one worker runs many cases: a case's GPUs are its subprocess's, not the worker's
_RUN_CASE = ray.remote(max_calls=0, max_retries=0)(run_case)
_HOLD = ray.remote(max_calls=0, max_retries=0)(hold_bundle)
_SINK = ray.remote(LogSink)


@dataclass(frozen=True)
class RayOptions:
    address: str
    retry_lost: int = 0
    working_dir: Path | None = None  # uploaded as the runtime env's working dir
    gpu_shares: int = 1  # cases' `gpus` count shares of a GPU (ci/gpu_shares.py), Ray's fractions


def connect(options: RayOptions, repo: Path) -> None:
    """Joins the cluster as a driver. Without a working dir, the nodes have the repository
    at the same path as here, and workers import `ci` from it."""
    if options.working_dir:
        runtime_env = {"working_dir": str(options.working_dir),
                       "excludes": [".git", "logs", "outputs", "*.sqlite"]}
        ray.init(address=options.address, runtime_env=runtime_env, logging_level="WARNING")
    else:
        job = JobConfig(_py_driver_sys_path=[str(repo)])
        ray.init(address=options.address, job_config=job, logging_level="WARNING")


def gpu_nodes(shares: int = 1) -> list[GpuNode]:
    """The live nodes and their GPUs, counted in shares of `shares` per GPU."""
    return [GpuNode(n["NodeID"], int(n.get("Resources", {}).get("GPU", 0)) * shares)
            for n in ray.nodes() if n.get("Alive")]


def unschedulable(case: Case, nodes: Sequence[GpuNode]) -> str | None:
    """Why Ray could never place the case on these nodes (it would wait forever), or None."""
    sizes = sorted((n.gpus for n in nodes), reverse=True)
    largest = sizes[0] if sizes else 0
    per_node = case.gpus_per_node
    if case.nodes > 1 and per_node < 1:
        return f"a multi-node case needs GPUs on each node, has {case.gpus} for {case.nodes} nodes"
    if case.nodes == 1 or case.placement == "STRICT_PACK":
        if largest < case.gpus:
            return f"needs {case.gpus} GPUs on one node, the largest node has {largest}"
        return None
    fitting = [s for s in sizes if s >= per_node]
    if case.placement == "STRICT_SPREAD" and len(fitting) < case.nodes:
        return f"needs {case.nodes} nodes with {per_node} GPUs each, the cluster has {len(fitting)}"
    if sum(s // per_node for s in sizes) < case.nodes:
        return f"needs {case.nodes} bundles of {per_node} GPUs, the cluster holds fewer"
    return None


def lead_cases(cases: Sequence[Case], nodes: Sequence[GpuNode]) -> list[Case]:
    """The cases that start before any other: those needing more than half a node, or several
    nodes. Whole-node bundles first, so that they pair up on the nodes, then wider, then longer.
    Left to the dispatch rule, narrow cases would fill every GPU that frees and these would
    wait until the end."""
    largest = max((n.gpus for n in nodes), default=0)
    wide = [c for c in cases if c.gpus and (c.nodes > 1 or 2 * c.gpus > largest)]
    return sorted(wide, key=lambda c: (-c.gpus_per_node, -c.gpus, -c.est_time))


@dataclass
class _Attempt:
    case: Case
    number: int
    ref: ray.ObjectRef
    holders: list
    group: object | None  # the placement group of a multi-node case
    nodes: list[str]  # the nodes the dispatcher counted on


class RaySuiteRunner:
    def __init__(self, cases: Sequence[Case], plan: Plan, settings: RunSettings,
                 options: RayOptions, nodes: Sequence[GpuNode], lead: int = 0,
                 on_finish: Callable[[CaseResult], None] | None = None):
        self.cases = {c.name: c for c in cases}
        self.plan, self.settings, self.options, self.nodes = plan, settings, options, list(nodes)
        self.on_finish = on_finish or (lambda result: None)
        self.pending: dict[ray.ObjectRef, _Attempt] = {}
        self.results: dict[str, CaseResult] = {}
        self.lost: dict[str, list[tuple[str, str]]] = {}  # name -> [(node, log tail)]
        self.t0 = time.time()
        self.sink = None
        self.dispatcher: ClusterDispatcher | None = None
        self.attempts: dict[str, int] = {}
        self.lead = lead  # the plan's first `lead` cases start before any other
        self.retiring: list[tuple[_Attempt, float]] = []  # groups to remove, and by when

    def run(self) -> list[CaseResult]:
        for directory in ("logs", "junit", "results"):
            (self.settings.out_dir / directory).mkdir(parents=True, exist_ok=True)
        here = ray.get_runtime_context().get_node_id()
        self.sink = _SINK.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            here, soft=False)).remote(str(self.settings.out_dir / "logs"))
        placeable = self._placeable()
        lead = {job.name for job in self.plan.order[:self.lead]}
        self.dispatcher = ClusterDispatcher(placeable, self.nodes, self.plan.cpu_slots,
                                            lead={c.name for c in placeable if c.name in lead})
        dispatcher = self.dispatcher
        self.t0 = time.time()
        try:
            while True:
                for case, nodes in dispatcher.start_ready():
                    self._submit(case, self.attempts.get(case.name, 0) + 1, nodes)
                if not self.pending:
                    break
                for name in self._collect_some():
                    dispatcher.release(name)
        except (KeyboardInterrupt, SystemExit):
            self._abandon(dispatcher)
        finally:
            for attempt in list(self.pending.values()):
                ray.cancel(attempt.ref, force=True)
                self._release(attempt)
            self._retire(force=True)
        return [self.results[name] for name in self.cases if name in self.results]

    def _placeable(self) -> list[Case]:
        """The plan's order, less the cases no node of the cluster can take (skipped)."""
        cases = []
        for job in self.plan.order + self.plan.unschedulable:
            why = unschedulable(self.cases[job.name], self.nodes)
            if why:
                self.results[job.name] = unschedulable_result(self.cases[job.name], why)
            else:
                cases.append(self.cases[job.name])
        return cases

    # -- submitting ------------------------------------------------------------------------

    def _log_name(self, case: Case) -> str:
        return f"{safe_filename(case.name)}.log"

    def _spec(self, case: Case, attempt: int) -> CaseSpec:
        cwd = None if self.options.working_dir else str(self.settings.workdir)
        return CaseSpec(case.name, tuple(case_argv(case, self.settings)), wants_junit(case), cwd,
                        case_deadline(case, self.settings), attempt, dict(self.settings.case_env))

    def _submit(self, case: Case, number: int, nodes: list[str]) -> None:
        self.attempts[case.name] = number
        num_gpus = ray_gpu_request(case.gpus_per_node, self.options.gpu_shares)
        resources = {"num_gpus": num_gpus, "num_cpus": 0 if case.gpus else 1,
                     "name": f"ci:{case.name}"}
        args = (self._spec(case, number), self.sink, self._log_name(case))
        if case.nodes == 1:
            # on the node the dispatcher counted on: Ray's own choice could differ, and the
            # count would then be wrong (Ray assigns the devices on that node)
            if nodes:
                resources["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[0], soft=False)
            self._track(_Attempt(case, number, _RUN_CASE.options(**resources).remote(*args), [], None,
                                 nodes))
            return
        group = placement_group([{"GPU": num_gpus}] * case.nodes,
                                strategy=case.placement, name=f"ci:{case.name}:{number}")

        def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)

        ref = _RUN_CASE.options(**resources, scheduling_strategy=in_bundle(0)).remote(
            *args, case.nodes - 1)
        holders = [_HOLD.options(num_gpus=num_gpus, num_cpus=0, name=f"ci:{case.name}:hold",
                                 scheduling_strategy=in_bundle(i)).remote(
                       self.sink, case.name, number, [ref])
                   for i in range(1, case.nodes)]
        self._track(_Attempt(case, number, ref, holders, group, nodes))

    def _track(self, attempt: _Attempt) -> None:
        self.pending[attempt.ref] = attempt

    def _release(self, attempt: _Attempt) -> None:
        """A multi-node case's group goes once its holders have ended (a moment after their
        lead; killing them mid-way would cost a worker restart on their nodes). Meanwhile the
        runner goes on: cases that come next on those GPUs start when the group is gone."""
        if attempt.group is not None:
            self.retiring.append((attempt, time.monotonic() + HOLDER_GRACE_S))
        self._retire()

    def _retire(self, force: bool = False) -> None:
        for item in list(self.retiring):
            attempt, deadline = item
            done, _ = ray.wait(attempt.holders, num_returns=len(attempt.holders), timeout=0)
            if force or len(done) == len(attempt.holders) or time.monotonic() > deadline:
                remove_placement_group(attempt.group)
                self.retiring.remove(item)

    # -- collecting ------------------------------------------------------------------------

    def _collect_some(self) -> list[str]:
        """Waits (a second at most) for attempts to end; returns the cases that are done.

        A multi-node case's holders are watched too: one holds its node until the lead ends, so
        a holder that ends first went down with its node, and the case is lost with it."""
        self._retire()
        timeout = 0.05 if self.retiring else 1.0
        holders = {h: attempt for attempt in self.pending.values() for h in attempt.holders}
        ready, _ = ray.wait(list(self.pending) + list(holders), num_returns=1, timeout=timeout)
        done = []
        for ref in ready:
            if ref in self.pending:
                name = self._collect(self.pending.pop(ref))
            elif holders[ref].ref in self.pending:
                name = self._holder_ended(holders[ref], ref)
            else:
                name = None
            if name:
                done.append(name)
        return done

    def _holder_ended(self, attempt: _Attempt, holder: ray.ObjectRef) -> str | None:
        """A holder ended before its lead: if a node of the case died, the case is lost there."""
        attempt.holders = [h for h in attempt.holders if h != holder]
        node = self._dead_peer_node(attempt)
        if node is None:
            return None  # the holder's worker died alone; the lead decides the outcome
        self.pending.pop(attempt.ref, None)
        ray.cancel(attempt.ref, force=True)  # its process dies with the worker (PR_SET_PDEATHSIG)
        self._release(attempt)
        return self._on_lost(attempt, *node)

    def _dead_peer_node(self, attempt: _Attempt) -> tuple[str, str] | None:
        peers = ray.get(self.sink.peers.remote(attempt.case.name, attempt.number))
        return first_dead({slot.node_id: slot.label for slot in peers}, NODE_DEATH_WAIT)

    def _collect(self, attempt: _Attempt) -> str | None:
        """The case's name once it has a result; None when it was queued again."""
        try:
            record: CaseRecord | None = ray.get(attempt.ref)
            error = ""
        except RayError as err:
            node = self._dead_node(attempt, err)
            if node is not None:
                self._release(attempt)
                return self._on_lost(attempt, *node)
            gone = isinstance(err, WORKER_GONE)
            record = None
            error = (f"the Ray worker running the case died: {first_line(err)}" if gone
                     else f"Ray could not run the case: {first_line(err)}")
        self._release(attempt)
        self._finish(self._result(attempt, record, error))
        return attempt.case.name

    def _dead_node(self, attempt: _Attempt, err: Exception) -> tuple[str, str] | None:
        """(id, label) of the node the attempt ran or was to run on, if that node is dead now
        or soon (a worker that died alone leaves its node alive)."""
        placed = ray.get(self.sink.placement.remote(attempt.case.name))
        if placed is not None and placed[1] == attempt.number:
            node_id, label = placed[0].node_id, placed[0].label
        elif attempt.nodes:  # lost before it started
            node_id, label = attempt.nodes[0], node_label(attempt.nodes[0])
        else:
            return None
        if isinstance(err, NodeDiedError):
            return node_id, label
        return first_dead({node_id: label}, NODE_DEATH_WAIT if isinstance(err, WORKER_GONE) else 0.0)

    def _on_lost(self, attempt: _Attempt, node_id: str, node: str) -> str | None:
        """Queues the case again, first in line, or records it as lost."""
        case = attempt.case
        log_path = self.settings.out_dir / "logs" / self._log_name(case)
        self.lost.setdefault(case.name, []).append((node, tail(log_path)))
        self.dispatcher.drop_node(node_id)
        if attempt.number <= self.options.retry_lost:
            print(f"{'lost':>8} {'':8}  {case.name} (node {node} died; rerunning elsewhere)", flush=True)
            self.dispatcher.requeue(case)
            return None
        result = self._base_result(case)
        result.outcome = "error"
        result.message = (f"{NODE_LOST}: node {node} died while the case ran "
                          f"(attempt {attempt.number})")
        result.node = node
        result.log_tail = self.lost[case.name][-1][1]
        self._finish(result)
        return case.name

    def _base_result(self, case: Case) -> CaseResult:
        log_path = self.settings.out_dir / "logs" / self._log_name(case)
        lost = self.lost.get(case.name, [])
        return CaseResult(case.name, case.nodeid, case.gpus, case.est_time, log_path=str(log_path),
                          lost_on=tuple(node for node, _ in lost),
                          lost_tail=lost[-1][1] if lost else "")

    def _result(self, attempt: _Attempt, record: CaseRecord | None, error: str) -> CaseResult:
        case = attempt.case
        result = self._base_result(case)
        if record is None:
            result.outcome, result.message = "error", error
            result.log_tail = tail(Path(result.log_path))
            return result
        result.start, result.wall_time = record.started_at - self.t0, record.ended_at - record.started_at
        result.gpus = tuple(f"{s.node_id[:6]}:{g}" for s in record.slots for g in s.gpus)
        result.node = " + ".join(s.label for s in record.slots)
        junit = self.settings.out_dir / "junit" / f"{safe_filename(case.name)}.xml"
        if record.junit_xml is not None:
            junit.write_text(record.junit_xml)
        if record.harness_result is not None:
            path = self.settings.results_dir / f"{case.name}.json"
            path.write_text(json.dumps(record.harness_result))
        conclude(result, Ended(record.exit_code, record.timed_out, junit), case, self.settings)
        return result

    def _finish(self, result: CaseResult) -> None:
        self.results[result.name] = result
        self.on_finish(result)

    def _abandon(self, dispatcher: ClusterDispatcher) -> None:
        """A cancelled run still reports: what ran is interrupted, what waited never started."""
        for case in dispatcher.waiting:
            self.results[case.name] = unschedulable_result(
                case, "not started: the suite run was cancelled")
        for attempt in list(self.pending.values()):
            ray.cancel(attempt.ref, force=True)
            placed = ray.get(self.sink.placement.remote(attempt.case.name))
            started = placed is not None and placed[1] == attempt.number
            result = self._base_result(attempt.case)
            if started:
                result.outcome, result.message = "error", "interrupted: the suite run was cancelled"
                result.log_tail = tail(Path(result.log_path))
            else:
                result.outcome, result.message = "skipped", "not started: the suite run was cancelled"
            self.results[result.name] = result


def node_label(node_id: str) -> str:
    """As NodeSlot.label: address and short id (dead nodes stay listed)."""
    ip = next((n.get("NodeManagerAddress") for n in ray.nodes() if n["NodeID"] == node_id), "?")
    return f"{ip}/{node_id[:6]}"


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def first_dead(nodes: dict[str, str], wait_s: float) -> tuple[str, str] | None:
    """(id, label) of the first of `nodes` ({id: label}) the cluster reports dead, asked once a
    second for up to `wait_s` (its health checks take a while to notice); None if all live."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = alive_node_ids()
        dead = [node_id for node_id in nodes if node_id not in alive]
        if dead:
            return dead[0], nodes[dead[0]]
        if time.monotonic() >= deadline:
            return None
        time.sleep(1.0)


def first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
