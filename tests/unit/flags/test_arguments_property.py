"""Property: validation accepts exactly the knob combinations a brute-force count calls consistent.

The brute force here is written independently of miles.flags.batching: it enumerates the pairs,
deals them to ranks by the definition of each split mode, counts what each rank and optimizer step
gets, and tiles each step's pairs, then says whether every count came out whole and equal, and
(with rollouts) whether every forward is one the engines ran: one microgroup's samples at one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from miles.flags.arguments import ConfigError, validate_argv
from miles.diffusion_facts.schedule import sigma_schedule

pytestmark = pytest.mark.filterwarnings("ignore")


@dataclass(frozen=True)
class Knobs:
    rollout_batch_size: int
    n_samples: int
    num_steps: int
    sde_steps: int
    nodes: int
    gpus_per_node: int
    sp: int
    gbs: int | None
    steps_per_rollout: int | None
    mbs: int | None
    tile_samples: int | None
    tile_steps: int | None
    split: str
    order: str
    family: str = "sd3"
    shift: float | None = None
    strategy: str = "sde_window"
    max_start: int = 0
    microgroup: int | None = None
    loss: str = "policy_loss"

    def argv(self) -> list[str]:
        argv = ["--hf-checkpoint", f"/ckpt/{self.family}", "--num-rollout", "1", "--loss-type", self.loss,
                "--prompt-data", "p.jsonl", "--device", "cpu", "--colocate", "--num-gpus-per-node", "64",
                "--rollout-batch-size", str(self.rollout_batch_size),
                "--n-samples-per-prompt", str(self.n_samples),
                "--diffusion-num-steps", str(self.num_steps), "--diffusion-num-sde-steps", str(self.sde_steps),
                "--actor-num-nodes", str(self.nodes), "--actor-num-gpus-per-node", str(self.gpus_per_node),
                "--sequence-parallel-size", str(self.sp),
                "--train-dp-split-mode", self.split, "--diffusion-train-iter-order", self.order,
                "--diffusion-step-strategy-path", self.strategy,
                "--diffusion-sde-window-max-start", str(self.max_start)]
        optional = {"--global-batch-size": self.gbs, "--num-steps-per-rollout": self.steps_per_rollout,
                    "--micro-batch-size-sample": self.tile_samples, "--micro-batch-size-tstep": self.tile_steps,
                    "--diffusion-shift": self.shift, "--micro-batch-size": self.mbs,
                    "--rollout-microgroup-size": self.microgroup}
        if self.loss != "sft_loss":
            argv += ["--rm-type", "brightness"]
        argv += [str(item) for flag, value in optional.items() if value is not None for item in (flag, value)]
        if self.family == "wan2_2":
            argv += ["--diffusion-guidance-scale-2", "3.0"]
        return argv


# ---- the brute force ----

def resolve_batch(k: Knobs, samples: int) -> tuple[int, int] | None:
    """(samples per optimizer step, optimizer steps) if the trajectory-level identity holds."""
    if k.gbs is not None and k.steps_per_rollout is not None:
        return (k.gbs, k.steps_per_rollout) if k.gbs * k.steps_per_rollout == samples else None
    if k.gbs is not None:
        return (k.gbs, samples // k.gbs) if samples % k.gbs == 0 else None
    steps = k.steps_per_rollout or 1
    return (samples // steps, steps) if samples % steps == 0 else None


def deal(pairs: list, dp: int, split: str) -> list[list]:
    ranks = [[] for _ in range(dp)]
    for index, pair in enumerate(pairs):
        rank = index % dp if split == "stride" else index * dp // len(pairs)
        ranks[rank].append(pair)
    return ranks


def microgroup(k: Knobs) -> int | None:
    """Samples per engine forward when rollouts are trained (None: SFT has no rollouts)."""
    return None if k.loss == "sft_loss" else (k.microgroup or k.n_samples)


def tiles(window: list, k: Knobs) -> list[list] | None:
    """The window's forwards, or None when it cannot be tiled into equal forwards."""
    tile_samples, tile_steps = k.tile_samples, k.tile_steps
    if tile_samples is None and k.mbs is None and microgroup(k):  # unset: the rollout tile
        tile_samples, tile_steps = microgroup(k), 1
    if tile_samples is None:
        mbs = k.mbs or 1
        if len(window) % mbs:
            return None
        return [window[i:i + mbs] for i in range(0, len(window), mbs)]
    samples = list(dict.fromkeys(s for s, _ in window))
    steps = sorted({t for _, t in window})
    if {(s, t) for s in samples for t in steps} != set(window) or len(window) != len(samples) * len(steps):
        return None
    if len(samples) % tile_samples or len(steps) % tile_steps:
        return None
    return [[(s, t) for s in samples[i:i + tile_samples] for t in steps[j:j + tile_steps]]
            for i in range(0, len(samples), tile_samples) for j in range(0, len(steps), tile_steps)]


def is_engine_forward(forward: list, group: int) -> bool:
    """One step, and samples g*M .. g*M + M - 1 in order: prompt p's samples are p*n .. p*n + n - 1,
    and its microgroups cut them into runs of M."""
    samples = [s for s, _ in forward]
    start = samples[0] // group * group
    return len({t for _, t in forward}) == 1 and samples == list(range(start, start + group))


def brute_force_layout(k: Knobs, trained_steps: list[int]) -> dict | None:
    """Every rank's optimizer steps and forwards, with the counts, or None if anything is uneven."""
    world = k.nodes * k.gpus_per_node
    # sequence parallelism is not implemented: any size but 1 is refused (miles/flags/validation.py)
    if k.sp != 1 or world % k.sp or (k.tile_samples is None) != (k.tile_steps is None):
        return None
    if k.tile_samples is not None and (k.mbs or 1) > 1:  # a flat size beside a tile would have no effect
        return None
    dp = world // k.sp
    samples = k.rollout_batch_size * k.n_samples
    batch = resolve_batch(k, samples)
    if batch is None or batch[0] % dp:
        return None
    steps_per_rollout = batch[1]
    pairs = [(s, t) for s in range(samples) for t in trained_steps]
    shards = deal(pairs, dp, k.split)
    if len({len(shard) for shard in shards}) != 1 or len(shards[0]) % steps_per_rollout:
        return None
    per_step = len(shards[0]) // steps_per_rollout
    windows = [shard[i:i + per_step] for shard in shards for i in range(0, len(shard), per_step)]
    forwards = [tiles(window, k) for window in windows]
    if any(f is None for f in forwards) or len({len(f) for f in forwards}) != 1:
        return None
    group = microgroup(k)
    if group and not all(is_engine_forward(forward, group) for f in forwards for forward in f):
        return None
    return {"samples_per_rollout": samples, "train_pairs": len(pairs), "dp_size": dp,
            "pairs_per_rank": len(shards[0]), "pairs_per_step_per_rank": per_step,
            "pairs_per_forward": len(forwards[0][0]), "forwards_per_step": len(forwards[0]),
            "forwards": [forward for f in forwards for forward in f]}


def assert_validation_matches(knobs: Knobs, expected: dict | None) -> None:
    if expected is None:
        event("refused")
        with pytest.raises(ConfigError):
            validate_argv(knobs.argv())
        return
    event("accepted")
    plan = validate_argv(knobs.argv())
    got = {key: getattr(plan, key) for key in expected if key != "forwards"}
    assert got == {key: value for key, value in expected.items() if key != "forwards"}


# ---- knob strategies ----

@st.composite
def batch_knobs(draw, max_steps: int = 5) -> dict:
    rbs, n = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    samples = rbs * n
    num_steps = draw(st.integers(1, max_steps))
    divisor = st.sampled_from([d for d in range(1, samples + 1) if samples % d == 0])
    gbs = draw(st.one_of(st.none(), st.none(), divisor, st.integers(1, 2 * samples)))
    steps = draw(st.one_of(st.none(), st.none(), divisor, st.integers(1, 8)))
    microgroup = draw(st.one_of(st.none(), st.sampled_from([d for d in range(1, n + 1) if n % d == 0])))
    tile_samples = draw(st.one_of(st.none(), st.integers(1, 4), st.just(microgroup or n)))
    tile_steps = draw(st.one_of(st.none(), st.integers(1, 3)))
    if draw(st.integers(0, 9)) > 0:  # mostly both or neither; sometimes one alone, which is refused
        tile_steps = None if tile_samples is None else (tile_steps or 1)
    nodes, gpus_per_node = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    world_divisor = st.sampled_from([d for d in range(1, nodes * gpus_per_node + 1) if nodes * gpus_per_node % d == 0])
    return dict(rollout_batch_size=rbs, n_samples=n, num_steps=num_steps,
                sde_steps=draw(st.integers(1, num_steps)), nodes=nodes, gpus_per_node=gpus_per_node,
                sp=draw(st.one_of(st.just(1), world_divisor, st.integers(1, 4))),
                gbs=gbs, steps_per_rollout=steps, mbs=draw(st.sampled_from([None, None, 1, 1, 2, 2, 3, 4, 6, 8])),
                tile_samples=tile_samples, tile_steps=tile_steps, microgroup=microgroup,
                split=draw(st.sampled_from(["contiguous", "stride"])),
                order=draw(st.sampled_from(["sample-major", "timestep-major"])))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_knobs())
@example(dict(  # a stride shard that is no samples x timesteps grid cannot be 2D-tiled
    rollout_batch_size=3, n_samples=2, num_steps=2, sde_steps=2, nodes=1, gpus_per_node=3, sp=1, gbs=None,
    steps_per_rollout=None, mbs=1, tile_samples=1, tile_steps=1, split="stride", order="sample-major"))
@example(dict(  # flat pairs of one sample at two steps are no engine forward
    rollout_batch_size=2, n_samples=2, num_steps=2, sde_steps=2, nodes=1, gpus_per_node=1, sp=1, gbs=None,
    steps_per_rollout=None, mbs=2, tile_samples=None, tile_steps=None, split="contiguous", order="sample-major"))
@example(dict(  # unset micro-batch flags: the rollout tile, a microgroup of 2 at one step
    rollout_batch_size=2, n_samples=4, num_steps=3, sde_steps=2, nodes=1, gpus_per_node=2, sp=1, gbs=None,
    steps_per_rollout=None, mbs=None, tile_samples=None, tile_steps=None, split="contiguous", order="sample-major",
    microgroup=2))
def test_validation_accepts_exactly_the_layouts_the_brute_force_count_calls_consistent(fields):
    knobs = Knobs(**fields)
    assert_validation_matches(knobs, brute_force_layout(knobs, list(range(knobs.sde_steps))))


# ---- Wan2.2: no forward may hold steps of both experts, for any step choice the strategy may make ----

def expert_of(step: int, sigmas: list[float]) -> str:
    return "high" if sigmas[step] * 1000 >= 0.875 * 1000 else "low"


def step_choices(k: Knobs) -> list[list[int]]:
    if k.strategy == "sde_window":
        return [list(range(start, start + k.sde_steps)) for start in range(k.max_start + 1)]
    return [list(chosen) for chosen in combinations(range(k.num_steps), k.sde_steps)]


def brute_force_wan(k: Knobs) -> dict | None:
    sigmas = sigma_schedule(k.num_steps, k.shift)
    layouts = [brute_force_layout(k, steps) for steps in step_choices(k)]
    if any(layout is None for layout in layouts):
        return None
    for layout in layouts:
        for forward in layout["forwards"]:
            if len({expert_of(step, sigmas) for _, step in forward}) > 1:
                return None
    return layouts[0]


@st.composite
def wan_knobs(draw) -> Knobs:
    """Mostly consistent batches, so the phase rule is what decides; short windows that slide
    across the boundary, and random choices of nearly every step, are where the rule is subtle."""
    num_steps = draw(st.integers(2, 8))
    # a custom strategy may return any steps; the rollout sorts them, so it is checked as any choice
    strategy = draw(st.sampled_from(["sde_window", "epoch_global_random_choice", "my_pkg.strategies:pick"]))
    if strategy == "sde_window":
        sde_steps = draw(st.one_of(st.integers(1, min(3, num_steps)), st.integers(1, num_steps)))
    else:
        sde_steps = draw(st.one_of(st.integers(1, num_steps), st.integers(max(1, num_steps - 2), num_steps)))
    latest = num_steps - sde_steps
    tiled = draw(st.booleans())
    return Knobs(rollout_batch_size=draw(st.sampled_from([1, 2, 3, 4])), n_samples=draw(st.sampled_from([1, 2, 4])),
                 num_steps=num_steps, sde_steps=sde_steps, nodes=1,
                 gpus_per_node=draw(st.sampled_from([1, 1, 2, 4])), sp=1, gbs=None,
                 steps_per_rollout=draw(st.sampled_from([None, 1, 2])),
                 mbs=draw(st.sampled_from([1, 2, 2, 3, 4])),
                 tile_samples=draw(st.integers(1, 2)) if tiled else None,
                 tile_steps=draw(st.integers(1, 3)) if tiled else None,
                 split=draw(st.sampled_from(["contiguous", "stride"])),
                 order=draw(st.sampled_from(["sample-major", "timestep-major"])),
                 family="wan2_2", shift=draw(st.sampled_from([1.0, 3.0, 12.0, 12.0])), strategy=strategy,
                 max_start=draw(st.one_of(st.just(latest), st.integers(0, latest))) if strategy == "sde_window" else 0,
                 loss=draw(st.sampled_from(["sft_loss", "sft_loss", "policy_loss"])))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wan_knobs())
@example(Knobs(  # only the latest window start (5) puts steps 5 and 6 in one forward
    rollout_batch_size=2, n_samples=2, num_steps=8, sde_steps=2, nodes=1, gpus_per_node=1, sp=1, gbs=None,
    steps_per_rollout=None, mbs=2, tile_samples=None, tile_steps=None, split="contiguous",
    order="sample-major", family="wan2_2", shift=12.0, strategy="sde_window", max_start=5, loss="sft_loss"))
@example(Knobs(  # a random choice of all 8 steps is one choice, and pairs (0,1)..(6,7) never straddle 6
    rollout_batch_size=2, n_samples=2, num_steps=8, sde_steps=8, nodes=1, gpus_per_node=1, sp=1, gbs=None,
    steps_per_rollout=None, mbs=2, tile_samples=None, tile_steps=None, split="contiguous",
    order="sample-major", family="wan2_2", shift=12.0, strategy="epoch_global_random_choice", loss="sft_loss"))
def test_wan22_validation_accepts_exactly_the_phase_pure_layouts(knobs):
    assert_validation_matches(knobs, brute_force_wan(knobs))


# ---- the brute force itself must be able to say no and yes ----

def test_brute_force_refuses_the_shard_rule_example_and_accepts_the_worked_example():
    worked = Knobs(rollout_batch_size=32, n_samples=16, num_steps=10, sde_steps=2, nodes=1, gpus_per_node=4,
                   sp=1, gbs=None, steps_per_rollout=2, mbs=1, tile_samples=8, tile_steps=1,
                   split="contiguous", order="sample-major", microgroup=8)
    counts = brute_force_layout(worked, [0, 1])
    assert (counts["pairs_per_step_per_rank"], counts["forwards_per_step"]) == (128, 16)
    shard_rule = Knobs(**{**worked.__dict__, "steps_per_rollout": 3})
    assert brute_force_layout(shard_rule, [0, 1]) is None
    whole_prompts = Knobs(**{**worked.__dict__, "microgroup": None})  # the engines forward 16, the tile holds 8
    assert brute_force_layout(whole_prompts, [0, 1]) is None
