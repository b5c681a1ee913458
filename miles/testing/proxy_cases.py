"""The cases most recipes have: the CPU proxy checked against its standard, the GPU proxy nightly.

    CASES = proxy_cases(RECIPE, gpus=5, labels=LABELS) + [one_gpu_check_case(RECIPE, LABELS)]
    test_recipe = recipe_test(CASES)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles.testing.cases import STOP_ON_PARITY_DRIFT, RecipeCase, Signal, parametrize_cases

RL_METRICS = ("rollout/reward/raw_mean", "train/loss", "train/grad_norm")
# two rollouts are too few for a reward trend: the signal that holds anywhere is a gradient
GRADIENT_SIGNALS = (Signal("train/grad_norm", "positive"),)


def proxy_cases(
    recipe: str, *, gpus: int, labels: Sequence[str], metrics: Sequence[str] = RL_METRICS,
    signals: Sequence[Signal] = GRADIENT_SIGNALS, cpu_est_time: int = 90, gpu_est_time: int = 1200,
    cpu_options: Mapping[str, Any] = {}, rehearsal_est_time: int = 150, **both: Any,
) -> list[RecipeCase]:
    """The CPU proxy (its metrics against the committed standard, its learning signals), the
    rehearsal of the GPU case (`--scale cpu-rehearsal`, nightly CPU suite) and the recipe's
    `--scale gpu-proxy` on `gpus` GPUs, which stops at the first off-policy rollout; `both` goes to
    each, `cpu_options` to the CPU-slot cases."""
    stop = STOP_ON_PARITY_DRIFT if both.get("parity", True) else ()  # SFT runs no engines: no probe
    return [
        RecipeCase.cpu(recipe, metrics=metrics, signals=signals, est_time=cpu_est_time,
                       labels=labels, **cpu_options, **both),
        rehearsal_case(recipe, labels, metrics, signals, rehearsal_est_time, **cpu_options, **both),
        RecipeCase.gpu(recipe, gpus=gpus, args=("--scale", "gpu-proxy") + stop,
                       est_time=gpu_est_time, labels=labels, **both),
    ]


def rehearsal_case(recipe: str, labels: Sequence[str], metrics: Sequence[str] = RL_METRICS,
                   signals: Sequence[Signal] = GRADIENT_SIGNALS, est_time: int = 150, scale: str = "cpu-rehearsal",
                   **options: Any) -> RecipeCase:
    """`--scale <scale> --num-rollout 2`, stopping at the first off-policy rollout where there is a probe."""
    stop = STOP_ON_PARITY_DRIFT if options.get("parity", True) else ()
    return RecipeCase.rehearsal(recipe, args=("--scale", scale, "--num-rollout", "2") + stop, metrics=metrics,
                                signals=signals, est_time=est_time, labels=labels, **options)


def one_gpu_check_case(recipe: str, labels: Sequence[str], signals: Sequence[Signal] = GRADIENT_SIGNALS) -> RecipeCase:
    """The GPU check's case (ci/gpu_check.sh): rank, engine and PickScore share one GPU."""
    return RecipeCase.gpu(recipe, gpus=1, args=("--scale", "1gpu-proxy") + STOP_ON_PARITY_DRIFT, variant="1gpu",
                          signals=signals,
                          est_time=300, timeout=420, labels=labels)


def recipe_test(cases: Sequence[RecipeCase]):
    """`test_recipe = recipe_test(CASES)`: runs each case and checks its run."""

    @parametrize_cases(cases)
    def test_recipe(recipe_case, run_recipe, check_run):
        check_run(run_recipe(recipe_case))

    return test_recipe
