"""A replay beside the memory plan: per phase and GPU, measured peak | plan estimate | budget.

A phase fails when its measured peak (plus each process's CUDA context, as the plan charges it)
is over the budget, or when the measured allocations and the plan's differ by more than
TOLERANCE of the larger. A failure names the phase, the GPU, the roles and the largest tensors
alive at the peak. Each node's host memory (`--host-memory-gb` minus the same headroom) is the
replayed train rank's and engine's host bytes composed into the node as the host plan composes
its own (miles.plan.host_plan): what only the plan models (process runtimes, the driver, the
reward workers, the object store) is the same on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from miles.replay.run import ENGINE, PHASES, RANK, ReplayResult, ReplayUnavailable, replay

GIB = 1024 ** 3
TOLERANCE = 0.15
# what the plan leaves out, whatever the model's size: the micro-batch's inputs, metric and RNG
# tensors, a scalar per parameter (AdamW's step), one weight's rows in flight; under 1 GiB on every
# case replayed (docs/memory-plan.md), so small host figures are not held to 15 % of themselves
SLACK = 1.0 * 1024 ** 3


class ReplayFailure(AssertionError):
    """A phase over its budget or more than TOLERANCE from the plan (the message names them)."""


class ReplayInputError(ValueError):
    """A recipe or scale the replay cannot take (one line, names the argument)."""


@dataclass
class Row:
    phase: str
    place: str
    measured: float  # bytes, CUDA context included
    estimate: float
    budget: float
    roles: dict[str, float] = field(default_factory=dict)
    top: list[str] = field(default_factory=list)
    compare: bool = True  # False: the plan has no estimate to hold it to

    @property
    def fits(self) -> bool:
        return self.measured <= self.budget

    @property
    def agrees(self) -> bool:
        if not self.compare:
            return True
        return abs(self.measured - self.estimate) <= max(TOLERANCE * max(self.measured, self.estimate), SLACK)

    @property
    def problem(self) -> str | None:
        what = []
        if not self.fits:
            what.append(f"over its budget of {self.budget / GIB:.1f} GiB")
        if not self.agrees:
            what.append(f"{self.measured / max(self.estimate, 1):.2f} x the plan's estimate "
                        f"{self.estimate / GIB:.1f} GiB (more than {TOLERANCE:.0%} and 1 GiB apart)")
        if not what:
            return None
        roles = ", ".join(f"{r} {b / GIB:.1f} GiB" for r, b in self.roles.items())
        top = "; ".join(self.top[:4]) or "none recorded"
        return (f"phase {self.phase!r} on the {self.place}: measured {self.measured / GIB:.1f} GiB ({roles}), "
                f"{' and '.join(what)}; largest tensors alive: {top}")


@dataclass
class Report:
    recipe: str
    scale: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    pinned: dict[str, tuple[int, int]] = field(default_factory=dict)  # offloaded part -> (arena, rounded) bytes

    @property
    def ok(self) -> bool:
        return all(r.problem is None for r in self.rows)

    def problems(self) -> list[str]:
        return [r.problem for r in self.rows if r.problem is not None]

    def check(self) -> None:
        if not self.ok:
            raise ReplayFailure("\n".join(self.lines()))

    def lines(self) -> list[str]:
        out = [f"replay of {self.recipe} --scale {self.scale} (GiB; measured | memory plan | budget)"]
        for r in self.rows:
            verdict = "ok" if r.problem is None else "FAILS"
            out.append(f"  {r.phase:16s} {r.place:12s} {r.measured / GIB:8.1f} | {r.estimate / GIB:8.1f} | "
                       f"{r.budget / GIB:7.1f}  {verdict}")
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  {p}" for p in self.problems()]
        return out

    def table_rows(self) -> list[str]:
        """docs/memory-plan.md's rows: | recipe | scale | GPU | phase | measured | plan | budget | verdict |."""
        name = Path(self.recipe).stem
        if not self.rows:
            return [f"| `{name}` | {self.scale} | - | - | - | - | - | {'; '.join(self.notes)} |"]
        return [f"| `{name}` | {self.scale} | {r.place} | {r.phase} | {r.measured / GIB:.1f} | "
                f"{r.estimate / GIB:.1f} | {r.budget / GIB:.0f} | {'ok' if r.problem is None else 'FAILS'} |"
                for r in self.rows]


def compare(result: ReplayResult, ns, plan, recipe: str, scale: str) -> Report:
    from miles.plan.memory_plan import CUDA_CONTEXT_GIB, phase_plan

    estimate = phase_plan(ns, plan)
    if estimate is None:
        raise ReplayUnavailable(f"{recipe} --scale {scale}: the memory plan has no estimate for it")
    rows = []
    for phase in PHASES:
        for m in (m for m in result.measures if m.phase == phase):
            processes = sum(result.processes[m.place].values())
            ctx = processes * CUDA_CONTEXT_GIB * GIB
            rows.append(Row(phase, m.place, m.peak + ctx, estimate.with_context(m.place, phase),
                            estimate.budget_gib * GIB, {r: b for r, b in m.roles.items()}, m.top))
    rows += host_rows(result, ns, estimate.host)
    notes = [f"{phase}: not replayed ({why})" for phase, why in result.skipped.items()]
    notes += pinned_notes(result)
    return Report(recipe, scale, rows, notes, dict(result.offload_layout))


def host_rows(result: ReplayResult, ns, host) -> list[Row]:
    """Each node's host memory: one replayed train rank's and engine's host bytes per phase in place of
    the plan's, composed into the node as the plan composes it (miles.plan.host_plan.compose_nodes)."""
    from miles.plan.host_plan import compose_nodes

    dp = getattr(ns, "train_backend", "dp") != "fsdp"  # a data-parallel checkpoint is rank 0's alone
    phases = result.host_phases
    rank = {p: float(v["idle rank"] if dp and p == "checkpoint save" else v[RANK]) for p, v in phases.items()}
    engine = {p: float(v[ENGINE]) for p, v in phases.items()}
    copies = {"checkpoint save": float(phases["checkpoint save"][RANK] - rank["checkpoint save"])}
    measured = compose_nodes(ns, host.roles, rank, engine, copies, host.procs.scorer, host.sample)
    budget = host.budget_gib * GIB
    return [Row("host", f"node {m.roles.index}", m.total, planned.total, budget,
                {what: b.get(m.peak_phase, 0.0) for what, b in m.parts.items()})
            for m, planned in zip(measured, host.nodes)]


def pinned_notes(result: ReplayResult) -> list[str]:
    """What the offload arenas hold per process, and what torch's pinned allocator would have."""
    if not result.offload_layout:
        return []
    parts = "; ".join(f"{name} {arena / GIB:.1f} GiB (rounded {rounded / GIB:.1f})"
                      for name, (arena, rounded) in result.offload_layout.items() if arena)
    arena = sum(a for a, _ in result.offload_layout.values())
    rounded = sum(r for _, r in result.offload_layout.values())
    return [f"pinned offload per GPU: {arena / GIB:.1f} GiB in exact arenas, where torch's power-of-two pinned "
            f"blocks would hold {rounded / GIB:.1f} GiB ({parts})"]


def replay_recipe(recipe: str | Path, scale: str, extrapolate: bool = False) -> Report:
    from miles.replay.recipe import recipe_flags, recipe_scales

    path = Path(recipe)
    if not path.is_file():
        raise ReplayInputError(f"recipe {recipe}: no such file; pass a scripts/run_*.py path")
    scales = recipe_scales(path)
    if scale not in scales:
        if not scales:
            raise ReplayInputError(f"{path.name} runs on CPU only: it has no GPU scale to replay; fix: replay a GPU "
                                   f"recipe (scripts/run_*.py other than the tiny CPU one)")
        raise ReplayInputError(f"--scale {scale}: {path.name} has the GPU scales {scales}; pick one of them")
    ns, plan = recipe_flags(path, scale)
    try:
        result = replay(ns, plan, extrapolate=extrapolate)
        return compare(result, ns, plan, str(recipe), scale)
    except ReplayUnavailable as error:
        return Report(str(recipe), scale, [], [f"not replayed: {error}"])
