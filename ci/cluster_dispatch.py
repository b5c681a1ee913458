"""When to hand a case to Ray: the one-node dispatch rule, counted node by node.

The rule is the packer's (ci/scheduler.py): walk the priority list and start every waiting case
whose GPUs are free now. On a cluster, "free" is per node: a single-node case needs one node
with that many free GPUs, a multi-node case one such bundle on each of `nodes` nodes (distinct
nodes unless its placement packs them). The runner submits a case to Ray only when it fits, on
the node it counted on; Ray assigns the devices there (and places multi-node bundles itself).
The `lead` cases (whole-node and multi-node ones) start before any other: while one of them
waits, nothing else starts, or narrow cases would fill every GPU that frees and keep it waiting.

Why not hand Ray everything at once: Ray does not keep submission order between tasks of
different shapes or between tasks and placement groups. A 4-GPU case or a multi-node placement
group waits while every GPU that frees goes to a queued 1-GPU task, and runs last, alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ci.cases import Case


@dataclass(frozen=True)
class GpuNode:
    node_id: str
    gpus: int


@dataclass
class ClusterDispatcher:
    waiting: list[Case]
    nodes: Sequence[GpuNode]
    cpu_slots: int = 1
    lead: set[str] = field(default_factory=set)
    free: dict[str, int] = field(default_factory=dict)
    held: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # case -> (node, GPUs)

    def __post_init__(self) -> None:
        self.free = {n.node_id: n.gpus for n in self.nodes}

    def start_ready(self) -> list[tuple[Case, list[str]]]:
        """The waiting cases that fit now, in priority order, with the nodes counted for them."""
        started = []
        leading = any(c.name in self.lead for c in self.waiting)
        for case in list(self.waiting):
            if leading and case.name not in self.lead:
                break
            placed = self._take(case)
            if placed is None:
                continue
            self.waiting.remove(case)
            self.held[case.name] = placed
            started.append((case, [node for node, _ in placed]))
        return started

    def release(self, name: str) -> None:
        placed = self.held.pop(name)
        if not placed:
            self.cpu_slots += 1
        for node, gpus in placed:
            if node in self.free:  # not a node that died meanwhile
                self.free[node] += gpus

    def requeue(self, case: Case) -> None:
        """A case to run again (its node died): first in line."""
        self.release(case.name)
        self.waiting.insert(0, case)

    def drop_node(self, node_id: str) -> None:
        self.free.pop(node_id, None)

    def _take(self, case: Case) -> list[tuple[str, int]] | None:
        if case.gpus == 0:
            if self.cpu_slots <= 0:
                return None
            self.cpu_slots -= 1
            return []
        per = case.gpus if case.nodes == 1 or case.placement == "STRICT_PACK" else case.gpus_per_node
        bundles = 1 if per == case.gpus else case.nodes
        placed = self._fit(per, bundles, distinct=case.placement == "STRICT_SPREAD")
        if placed is None:
            return None
        for node in placed:
            self.free[node] -= per
        return [(node, per) for node in placed]

    def _fit(self, per: int, bundles: int, distinct: bool) -> list[str] | None:
        """Best fit: the fullest nodes that still take a bundle, so wide gaps stay open."""
        free = dict(self.free)
        placed = []
        for _ in range(bundles):
            fitting = [n for n, f in free.items() if f >= per and (not distinct or n not in placed)]
            if not fitting:
                return None
            node = min(fitting, key=lambda n: (free[n], n))
            free[node] -= per
            placed.append(node)
        return placed

