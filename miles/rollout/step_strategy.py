"""Which steps of a rollout are trained (run as SDE with a log-prob); the others run as ODE.

A strategy is `fn(args, rollout_id, num_steps, num_sde_steps, rng) -> list[int]`, the same list
for every sample of the rollout. `rng` is a `random.Random` seeded from --rollout-seed and the
rollout id, so a rollout's choice is reproducible.
"""

from __future__ import annotations

import random
from typing import Callable

StepStrategy = Callable[..., list]


def sde_window(args, rollout_id: int, num_steps: int, num_sde_steps: int, rng: random.Random) -> list[int]:
    """A contiguous window of num_sde_steps steps starting in [--diffusion-sde-window-min-start,
    --diffusion-sde-window-max-start]."""
    min_start = getattr(args, "diffusion_sde_window_min_start", 0) or 0
    max_start = getattr(args, "diffusion_sde_window_max_start", 0) or 0
    if max_start + num_sde_steps > num_steps:
        raise ValueError(
            f"--diffusion-sde-window-max-start {max_start} + {num_sde_steps} SDE steps exceeds {num_steps} steps"
        )
    # a min start of 0 draws exactly as before it existed (randint(0, max)): the same windows per seed
    start = rng.randint(min_start, max_start)
    return list(range(start, start + num_sde_steps))


def epoch_global_random_choice(args, rollout_id: int, num_steps: int, num_sde_steps: int, rng: random.Random) -> list[int]:
    """num_sde_steps distinct steps drawn uniformly from --diffusion-sde-candidate-steps, else from
    the first int(num_steps x --diffusion-timestep-fraction) (the reference's trained fraction: the
    terminal step only at 1.0), shared by all samples of the rollout."""
    candidates = getattr(args, "diffusion_sde_candidate_steps", None)
    if candidates:
        return sorted(rng.sample(sorted(candidates), num_sde_steps))
    fraction = getattr(args, "diffusion_timestep_fraction", 1.0)
    eligible = min(num_steps, max(num_sde_steps, int(num_steps * fraction)))
    return sorted(rng.sample(range(eligible), num_sde_steps))


BUILTIN: dict[str, StepStrategy] = {"sde_window": sde_window, "epoch_global_random_choice": epoch_global_random_choice}


def resolve_step_strategy(path: str) -> StepStrategy:
    """A built-in name, or a dotted path `pkg.mod:fn` / `pkg.mod.fn`."""
    if path in BUILTIN:
        return BUILTIN[path]
    from miles.utils.dotted_path import DottedPathError, load_callable

    try:
        return load_callable(path, what="step strategy")
    except DottedPathError as err:
        raise ValueError(f"{err} (built-ins: {', '.join(BUILTIN)})") from None


def rollout_rng(rollout_seed: int, rollout_id: int) -> random.Random:
    return random.Random(rollout_seed * 1_000_003 + rollout_id)


def trained_steps_for_rollout(args, rollout_id: int) -> list[int]:
    """The strategy named by --diffusion-step-strategy-path applied to this rollout, checked."""
    num_steps = args.diffusion_num_steps
    num_sde_steps = args.diffusion_num_sde_steps or max(1, int(num_steps * getattr(args, "diffusion_timestep_fraction", 1.0)))
    strategy = resolve_step_strategy(getattr(args, "diffusion_step_strategy_path", None) or "sde_window")
    steps = [int(s) for s in strategy(args, rollout_id, num_steps, num_sde_steps, rollout_rng(args.rollout_seed, rollout_id))]
    if len(set(steps)) != len(steps) or any(not 0 <= s < num_steps for s in steps):
        raise ValueError(f"step strategy returned {steps}; want distinct steps in [0, {num_steps})")
    return sorted(steps)
