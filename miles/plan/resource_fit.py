"""Can a cluster ever hold a run's layout? One rule for the launcher (before it submits) and the
driver (before it waits for its placement group).

A request is a list of bundles (resource shapes, each of which must land whole on one node);
the offer is the alive nodes with their *total* resources (what they would hold if nothing else
ran). The verdict is one of:

- `fits`: the bundles can be laid out on the nodes' totals. Whatever Ray still waits for is busy
  (held by other work), and waiting can end;
- `never`: they cannot, and every node the job expects is there: more GPUs/CPUs/memory in one
  bundle than any node has, or more in all than the nodes hold together. No wait can help;
- `missing nodes`: fewer nodes are alive than the job expects (`--num-nodes`), so the verdict
  waits for them.

Ray- and torch-free: the launcher's `--validate-only` path imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

FITS, NEVER, MISSING_NODES = "fits", "never", "missing nodes"
# resources a bundle names but a node does not have count as 0 there; Ray's bookkeeping keys
# (node:<ip>, object_store_memory, accelerator_type:...) are not ours to ask for
_EPS = 1e-9
_SEARCH_STEPS = 200_000  # past this the packing search gives up and says "fits": never refuse unproven


@dataclass(frozen=True)
class NodeOffer:
    name: str  # the node's address (or "this machine")
    resources: Mapping[str, float]  # totals: GPU, CPU, memory (bytes), ...

    def show(self) -> str:
        return f"{self.name} {show_shape(self.resources)}"


@dataclass(frozen=True)
class Request:
    what: str  # "2 train ranks and 2 rollout engines", "reward worker"
    bundles: Sequence[Mapping[str, float]]


@dataclass(frozen=True)
class Verdict:
    state: str  # FITS, NEVER or MISSING_NODES
    reason: str = ""  # one line naming the request and the offer (NEVER, MISSING_NODES)
    nodes: tuple[NodeOffer, ...] = field(default=())

    @property
    def never(self) -> bool:
        return self.state == NEVER


def show_shape(shape: Mapping[str, float]) -> str:
    """{'GPU': 1.0, 'CPU': 2.0, 'memory': 3e9} -> '{GPU: 1, CPU: 2, memory: 2.8 GiB}'."""
    return "{" + ", ".join(f"{key}: {_amount(key, shape[key])}" for key in sorted(shape, key=_key_order)) + "}"


def _amount(key: str, value: float) -> str:
    return f"{float(value) / 2**30:.1f} GiB" if key == "memory" else f"{float(value):g}"


def _key_order(key: str) -> tuple[int, str]:
    return ({"GPU": 0, "CPU": 1, "memory": 2}.get(key, 3), key)


def total(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    summed: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            summed[key] = summed.get(key, 0.0) + float(value)
    return summed


def judge(requests: Sequence[Request], nodes: Sequence[NodeOffer], expected_nodes: int = 1) -> Verdict:
    """The rule (module docstring). `nodes`: the alive nodes; `expected_nodes`: how many the job
    was told it has (`--num-nodes`)."""
    nodes = tuple(nodes)
    bundles = [(r.what, dict(b)) for r in requests for b in r.bundles if any(v > 0 for v in b.values())]
    offer = _show_offer(nodes)
    if len(nodes) < expected_nodes:
        return Verdict(MISSING_NODES, f"the job expects {expected_nodes} node(s) (--num-nodes) and "
                                      f"{len(nodes)} are alive ({offer})", nodes)
    for what, bundle in bundles:
        if not any(_holds(n.resources, bundle) for n in nodes):
            short = _shortest(bundle, nodes)
            return Verdict(NEVER, f"{what} asks for {show_shape(bundle)} on one node, but no node has {short}; "
                                  f"the cluster offers {offer}", nodes)
    if not _packs([b for _, b in bundles], [dict(n.resources) for n in nodes]):
        asked = show_shape(total([b for _, b in bundles]))
        return Verdict(NEVER, f"{_whats(requests)} ask for {asked} in all ({len(bundles)} bundle(s), each whole on one "
                              f"node), more than the nodes hold together; the cluster offers {offer}", nodes)
    return Verdict(FITS, "", nodes)


def _show_offer(nodes: Sequence[NodeOffer]) -> str:
    if not nodes:
        return "no alive node"
    return f"{len(nodes)} node(s): " + "; ".join(n.show() for n in nodes)


def _whats(requests: Sequence[Request]) -> str:
    return " + ".join(r.what for r in requests if r.bundles)


def _holds(resources: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
    return all(resources.get(k, 0.0) + _EPS >= v for k, v in bundle.items())


def _shortest(bundle: Mapping[str, float], nodes: Sequence[NodeOffer]) -> str:
    """What the largest node lacks, e.g. 'GPU: 1 (the most any node has: 0)'."""
    lacking = []
    for key, value in bundle.items():
        most = max((n.resources.get(key, 0.0) for n in nodes), default=0.0)
        if most + _EPS < value:
            lacking.append(f"{key} {_amount(key, value)} (the most any node has: {_amount(key, most)})")
    return " and ".join(lacking) or show_shape(bundle)


def _packs(bundles: list[dict[str, float]], capacity: list[dict[str, float]]) -> bool:
    """Whether every bundle can go whole onto some node within the nodes' totals. Exact search,
    largest bundles first; nodes with the same room left are tried once (they are alike)."""
    order = sorted(bundles, key=lambda b: tuple(-b.get(k, 0.0) for k in ("GPU", "CPU", "memory")))
    steps = [0]

    def place(i: int) -> bool:
        if i == len(order):
            return True
        steps[0] += 1
        if steps[0] > _SEARCH_STEPS:
            return True
        tried = set()
        for room in capacity:
            key = tuple(sorted(room.items()))
            if key in tried or not _holds(room, order[i]):
                continue
            tried.add(key)
            for k, v in order[i].items():
                room[k] = room.get(k, 0.0) - v
            if place(i + 1):
                return True
            for k, v in order[i].items():
                room[k] += v
        return False

    return place(0)
