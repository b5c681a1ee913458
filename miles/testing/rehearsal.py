"""What a rehearsal case does not share with its GPU case (issue 39): the dry check's report.

A rehearsal (`RecipeCase.rehearsal`, `--scale cpu-rehearsal`) is the GPU case's configuration on
CPU slots at the CPU proxy's size. Both argvs are parsed by train_diffusion.py's own parser and
compared setting by setting over `SETTINGS`: what decides the numerics and the code paths a run
takes (dtypes, train backend, offload, colocation and push, LoRA, gradient checkpointing, the
parity probe, the micro-batch tile and the engines' microgroup), not its sizes (resolution,
batch, steps, ranks), which a proxy scales down. Ideally the only difference is the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles.testing.cases import RecipeCase

SETTINGS = (
    "device", "param_dtype", "compute_dtype", "rollout_dtype", "train_backend", "fsdp_reduce_dtype",
    "offload_train", "offload_rollout", "colocate", "weight_sync", "update_weight_target_module",
    "use_lora", "lora_rank", "lora_alpha", "lora_target_modules", "gradient_checkpointing",
    "diffusion_debug_mode", "stop_on_parity_drift", "micro_batch_size", "micro_batch_size_sample",
    "micro_batch_size_tstep", "rollout_microgroup_size", "diffusion_train_iter_order", "train_dp_split_mode",
    "loss_type", "advantage_estimator", "diffusion_sde_type", "deterministic_mode",
)
THE_DEVICE = frozenset({"device"})  # what a rehearsal leaves out by definition


def settings(argv: Sequence[str]) -> dict[str, Any]:
    """The run's SETTINGS as train_diffusion.py parses them (defaults applied)."""
    from miles.flags.arguments import parse_and_plan

    ns, _ = parse_and_plan(list(argv))
    return {name: getattr(ns, name, None) for name in SETTINGS}


def differences(gpu_argv: Sequence[str], rehearsal_argv: Sequence[str]) -> dict[str, tuple[Any, Any]]:
    """setting -> (the GPU case's value, the rehearsal's) for each setting they do not share."""
    gpu, rehearsal = settings(gpu_argv), settings(rehearsal_argv)
    return {k: (gpu[k], rehearsal[k]) for k in SETTINGS if gpu[k] != rehearsal[k]}


def report(gpu_case: RecipeCase, rehearsal_case: RecipeCase, diff: Mapping[str, tuple[Any, Any]]) -> str:
    if set(diff) <= THE_DEVICE:
        return f"{rehearsal_case.name} rehearses {gpu_case.name}: every setting but the device"
    listed = "; ".join(f"--{k.replace('_', '-')} {g!r} (rehearsal: {r!r})" for k, (g, r) in diff.items())
    return f"{rehearsal_case.name} differs from {gpu_case.name} in: {listed}"


def rehearsal_pairs(cases: Sequence[RecipeCase]) -> list[tuple[RecipeCase, RecipeCase]]:
    """(GPU case, its rehearsal) for each GPU case of a recipe: the rehearsal of the same variant
    suffix (`rehearsal-fsdp` rehearses the recipe's full scale: its dry case, args of its own), else
    the recipe's plain rehearsal."""
    by_recipe: dict[str, list[RecipeCase]] = {}
    for case in cases:
        by_recipe.setdefault(case.script, []).append(case)
    pairs = []
    for script, own in by_recipe.items():
        rehearsals = {c.variant: c for c in own if c.is_rehearsal}
        if not rehearsals:
            continue
        for gpu in (c for c in own if c.tier == "gpu"):
            pairs.append((gpu, rehearsals.get("rehearsal") or next(iter(rehearsals.values()))))
        for variant, case in rehearsals.items():
            if variant == "rehearsal-fsdp":  # the full scale: what the recipe runs with no --scale
                full = RecipeCase.dry(script, args=(), name=f"{case.stem}-full")
                pairs.append((full, case))
    return pairs
