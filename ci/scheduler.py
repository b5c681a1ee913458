"""Packing test cases of different GPU counts onto one node's GPUs.

A job needs `gpus` GPUs for about `est_time` seconds; any `gpus` free GPUs will do (sets need
not be contiguous). Jobs with `gpus == 0` use one of a bounded number of CPU slots instead.

One dispatch rule serves both the plan and the real run: walk the priority list and start
every waiting job whose resources are free now. The planner simulates that rule on estimated
times and searches over priority lists; the runner feeds it real completions, so a test that
finishes early frees its GPUs at once instead of waiting for its planned end.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Job:
    name: str
    gpus: int
    est_time: float


@dataclass(frozen=True)
class Slot:
    name: str
    gpus: tuple[int, ...]
    start: float
    end: float


@dataclass
class Plan:
    order: list[Job]
    slots: list[Slot]
    pool: tuple[int, ...]
    cpu_slots: int
    unschedulable: list[Job]

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.slots), default=0.0)

    @property
    def lower_bound(self) -> float:
        return lower_bound(self.order, len(self.pool), self.cpu_slots)

    def slot_for(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)

    def as_json(self) -> list[dict]:
        return [
            {"name": s.name, "gpus": list(s.gpus), "start": s.start, "end": s.end}
            for s in sorted(self.slots, key=lambda s: (s.start, s.name))
        ]


def lower_bound(jobs: Iterable[Job], num_gpus: int, cpu_slots: int = 1) -> float:
    """max(sum(gpus x time) / GPUs, longest test), and the same for the CPU slots."""
    jobs = list(jobs)
    gpu_jobs = [j for j in jobs if j.gpus > 0]
    cpu_jobs = [j for j in jobs if j.gpus == 0]
    bound = max((j.est_time for j in jobs), default=0.0)
    if gpu_jobs and num_gpus:
        bound = max(bound, sum(j.gpus * j.est_time for j in gpu_jobs) / num_gpus)
    if cpu_jobs:
        bound = max(bound, sum(j.est_time for j in cpu_jobs) / max(cpu_slots, 1))
    return bound


class Dispatcher:
    """Tracks free GPUs and CPU slots and decides which waiting jobs start now."""

    def __init__(self, order: Sequence[Job], pool: Sequence[int], cpu_slots: int):
        self.waiting: list[Job] = list(order)
        self.free_gpus: set[int] = set(pool)
        self.free_cpu_slots = cpu_slots
        self.held: dict[str, tuple[int, ...]] = {}

    def start_ready(self) -> list[tuple[Job, tuple[int, ...]]]:
        started = []
        for job in list(self.waiting):
            gpus = self._take(job)
            if gpus is None:
                continue
            self.waiting.remove(job)
            self.held[job.name] = gpus
            started.append((job, gpus))
        return started

    def release(self, name: str) -> None:
        gpus = self.held.pop(name)
        if gpus:
            self.free_gpus.update(gpus)
        else:
            self.free_cpu_slots += 1

    def _take(self, job: Job) -> tuple[int, ...] | None:
        if job.gpus == 0:
            if self.free_cpu_slots <= 0:
                return None
            self.free_cpu_slots -= 1
            return ()
        if job.gpus > len(self.free_gpus):
            return None
        gpus = tuple(sorted(self.free_gpus)[: job.gpus])
        self.free_gpus.difference_update(gpus)
        return gpus


def simulate(order: Sequence[Job], pool: Sequence[int], cpu_slots: int) -> list[Slot]:
    """Runs the dispatch rule on estimated times; returns when and where each job runs."""
    dispatcher = Dispatcher(order, pool, cpu_slots)
    running: list[tuple[float, int, str]] = []
    slots: list[Slot] = []
    now = 0.0
    while True:
        for job, gpus in dispatcher.start_ready():
            end = now + job.est_time
            slots.append(Slot(job.name, gpus, now, end))
            heapq.heappush(running, (end, len(slots), job.name))
        if not running:
            break
        now = running[0][0]
        while running and running[0][0] == now:
            dispatcher.release(heapq.heappop(running)[2])
    return slots


def _score(order: Sequence[Job], num_gpus: int, cpu_slots: int) -> tuple[float, float]:
    """(makespan, GPU-weighted sum of end times) of the dispatch rule, counting GPUs only.

    Which GPUs a job gets never changes when it starts (any free ones will do), so the search
    can simulate with counts; `simulate` then assigns the actual ids once. The second term
    breaks the many ties of makespan: finishing GPU-seconds earlier leaves a tail that later
    moves can shorten.
    """
    waiting = list(order)
    free_gpus, free_cpu = num_gpus, cpu_slots
    running: list[tuple[float, int]] = []
    now = span = weighted = 0.0
    while True:
        still_waiting = []
        for job in waiting:
            if job.gpus == 0 and free_cpu > 0:
                free_cpu -= 1
            elif 0 < job.gpus <= free_gpus:
                free_gpus -= job.gpus
            else:
                still_waiting.append(job)
                continue
            end = now + job.est_time
            heapq.heappush(running, (end, job.gpus))
            span = max(span, end)
            weighted += end * max(job.gpus, 1)
        waiting = still_waiting
        if not running:
            return span, weighted
        now = running[0][0]
        while running and running[0][0] == now:
            _, gpus = heapq.heappop(running)
            if gpus:
                free_gpus += gpus
            else:
                free_cpu += 1


def _makespan(order: Sequence[Job], pool: Sequence[int], cpu_slots: int) -> float:
    return _score(order, len(pool), cpu_slots)[0]


def _seed_orders(jobs: list[Job], num_gpus: int) -> list[list[Job]]:
    keys = [
        lambda j: (-j.est_time, -j.gpus),
        lambda j: (-j.gpus * j.est_time, -j.gpus),
        lambda j: (-j.gpus, -j.est_time),
        # jobs wider than half the node can never overlap each other: start them early
        lambda j: (-(j.gpus * 2 > num_gpus), -j.est_time),
    ]
    return [sorted(jobs, key=key) for key in keys]


def _neighbour(order: list[Job], rng: random.Random, frozen: int = 0) -> list[Job]:
    """A move or a swap, leaving the first `frozen` jobs where they are."""
    new = list(order)
    i, k = rng.randrange(frozen, len(new)), rng.randrange(frozen, len(new))
    if rng.random() < 0.5:
        new[i], new[k] = new[k], new[i]
    else:
        new.insert(k, new.pop(i))
    return new


def improve(order: list[Job], pool: Sequence[int], cpu_slots: int, *, iterations: int,
            target: float, seed: int, frozen: int = 0) -> tuple[list[Job], float]:
    """Local search over priority lists, moving a job or swapping two; accepts non-worse."""
    rng = random.Random(seed)
    best, best_score = order, _score(order, len(pool), cpu_slots)
    current, current_score = best, best_score
    for _ in range(iterations):
        if best_score[0] <= target or len(order) - frozen < 2:
            break
        candidate = _neighbour(current, rng, frozen)
        score = _score(candidate, len(pool), cpu_slots)
        if score <= current_score:
            current, current_score = candidate, score
            if score < best_score:
                best, best_score = candidate, score
    return best, best_score[0]


def make_plan(jobs: Sequence[Job], pool: Sequence[int], cpu_slots: int = 1, *,
              iterations: int = 1500, seed: int = 0, first: Sequence[str] = ()) -> Plan:
    """Best priority list found by seeding with classic orders, then improving locally.

    Jobs named in `first` lead every order, in that order (on a cluster: the cases that need
    whole nodes or several nodes; planned late, they would wait for their nodes to drain)."""
    pool = tuple(pool)
    fits = [j for j in jobs if j.gpus <= len(pool)]
    unschedulable = [j for j in jobs if j.gpus > len(pool)]
    by_name = {j.name: j for j in fits}
    lead = [by_name[name] for name in first if name in by_name]
    rest = [j for j in fits if j not in lead]
    # no plan beats the tighter bound, so reaching it ends the search early
    bound = max(lower_bound(fits, len(pool), cpu_slots), wide_job_bound(fits, len(pool)))
    seeds = sorted((lead + o for o in _seed_orders(rest, len(pool))),
                   key=lambda o: _makespan(o, pool, cpu_slots))
    order, _ = improve(seeds[0], pool, cpu_slots, iterations=iterations,
                       target=bound * 1.0001, seed=seed, frozen=len(lead))
    return Plan(order, simulate(order, pool, cpu_slots), pool, cpu_slots, unschedulable)


def plan_problems(plan_json: list[dict], jobs: Sequence[Job], pool: Sequence[int]) -> list[str]:
    """Everything wrong with a plan: missing or repeated jobs, wrong GPU counts, overlaps."""
    problems = []
    by_name = {j.name: j for j in jobs}
    seen: dict[str, int] = {}
    for entry in plan_json:
        seen[entry["name"]] = seen.get(entry["name"], 0) + 1
        job = by_name.get(entry["name"])
        if job is None:
            problems.append(f"{entry['name']}: not in the suite")
            continue
        if len(set(entry["gpus"])) != job.gpus or len(entry["gpus"]) != job.gpus:
            problems.append(f"{job.name}: got GPUs {entry['gpus']}, needs {job.gpus}")
        if not set(entry["gpus"]) <= set(pool):
            problems.append(f"{job.name}: GPUs {entry['gpus']} outside the node {list(pool)}")
        if entry["end"] - entry["start"] < job.est_time - 1e-6:
            problems.append(f"{job.name}: slot shorter than its estimate")
    problems += [f"{n}: scheduled {c} times" for n, c in seen.items() if c != 1]
    problems += [f"{n}: never scheduled" for n in by_name if n not in seen]
    problems += _overlaps(plan_json)
    return problems


def _overlaps(plan_json: list[dict]) -> list[str]:
    problems = []
    for i, a in enumerate(plan_json):
        for b in plan_json[i + 1:]:
            shared = set(a["gpus"]) & set(b["gpus"])
            if shared and a["start"] < b["end"] and b["start"] < a["end"]:
                problems.append(f"{a['name']} and {b['name']} share GPUs {sorted(shared)}")
    return problems


def wide_job_bound(jobs: Iterable[Job], num_gpus: int) -> float:
    """A tighter bound than `lower_bound`, used to judge the packer rather than the suite.

    Jobs wider than half the node can never run together, so their times add up; beside
    each of them only jobs narrow enough to fit in the GPUs it leaves can run, and the rest of
    the narrow jobs' GPU-seconds must be done after (or before) them on the whole node.
    """
    jobs = [j for j in jobs if 0 < j.gpus <= num_gpus]
    wide = [j for j in jobs if 2 * j.gpus > num_gpus]
    narrow = [j for j in jobs if 2 * j.gpus <= num_gpus]
    if not wide:
        return lower_bound(jobs, num_gpus)
    widest_gap = max(num_gpus - j.gpus for j in wide)
    beside_capacity = sum((num_gpus - j.gpus) * j.est_time for j in wide)
    fitting_area = sum(j.gpus * j.est_time for j in narrow if j.gpus <= widest_gap)
    leftover = sum(j.gpus * j.est_time for j in narrow) - min(beside_capacity, fitting_area)
    bound = sum(j.est_time for j in wide) + max(0.0, leftover) / num_gpus
    return max(bound, lower_bound(jobs, num_gpus))

