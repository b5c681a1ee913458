"""The cases most recipes have: the CPU proxy checked against its standard, the GPU proxy nightly.

    CASES = proxy_cases(RECIPE, gpus=5, labels=LABELS) + [one_gpu_check_case(RECIPE, LABELS)]
    test_recipe = recipe_test(CASES)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles.testing.cases import RecipeCase, Signal, parametrize_cases

RL_METRICS = ("rollout/reward/raw_mean", "train/loss", "train/grad_norm")
# two rollouts are too few for a reward trend: the signal that holds anywhere is a gradient
GRADIENT_SIGNALS = (Signal("train/grad_norm", "positive"),)


def proxy_cases(
    recipe: str, *, gpus: int, labels: Sequence[str], metrics: Sequence[str] = RL_METRICS,
    signals: Sequence[Signal] = GRADIENT_SIGNALS, cpu_est_time: int = 90, gpu_est_time: int = 1200,
    cpu_options: Mapping[str, Any] = {}, **both: Any,
) -> list[RecipeCase]:
    """The CPU proxy (its metrics against the committed standard, its learning signals) and the
    recipe's `--scale gpu-proxy` on `gpus` GPUs; `both` goes to each, `cpu_options` to the first."""
    return [
        RecipeCase.cpu(recipe, metrics=metrics, signals=signals, est_time=cpu_est_time,
                       labels=labels, **cpu_options, **both),
        RecipeCase.gpu(recipe, gpus=gpus, args=("--scale", "gpu-proxy"), est_time=gpu_est_time, labels=labels,
                       **both),
    ]


def one_gpu_check_case(recipe: str, labels: Sequence[str], signals: Sequence[Signal] = GRADIENT_SIGNALS) -> RecipeCase:
    """The GPU check's case (ci/gpu_check.sh): rank, engine and PickScore share one GPU."""
    return RecipeCase.gpu(recipe, gpus=1, args=("--scale", "1gpu-proxy"), variant="1gpu", signals=signals,
                          est_time=300, timeout=420, labels=labels)


def recipe_test(cases: Sequence[RecipeCase]):
    """`test_recipe = recipe_test(CASES)`: runs each case and checks its run."""

    @parametrize_cases(cases)
    def test_recipe(recipe_case, run_recipe, check_run):
        check_run(run_recipe(recipe_case))

    return test_recipe
