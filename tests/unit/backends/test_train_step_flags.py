"""Trainer flags observed through a real train step: the tiny sd3 checkpoint, an engine's rollout,
`TrainRank.setup()` and `TrainRank.train()` in process, as a Ray train actor runs them.

Each test changes one flag and looks at what the rank did with it (the weights it stepped to,
the learning rate it set, the backward passes it ran, the EMA it kept and saved), so a flag that
the trainer reads but ignores fails here. `python3 -m tests.tools.mutation_check` proves it: it
makes each flag a no-op in the source, one at a time, and shows the flag's test failing.
"""

from __future__ import annotations

import json

import pytest
import torch

from dtype_helpers import engine_for, one_rollout, tiny_args, tiny_assets
from miles.backends.actor import TrainRank

# fp32 rounding of one op: a lerp or a product is exact to half an ulp of its result
FP32_EPS = torch.finfo(torch.float32).eps


def train_once(run_dir, flags: str = "", batch=None, passes: int = 1):
    """One rollout trained by one rank `passes` times; (rank, last metrics, batch). `batch` reuses a
    rollout: the sampling flags are the same, so the trainer flags are all that differs."""
    args, plan = tiny_args(run_dir, flags)
    batch = batch if batch is not None else one_rollout(args, 0, engine_for(args))
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    start = rank.trained_state()
    for _ in range(passes):
        metrics = rank.train(batch).metrics
    rank.start_state = start
    return rank, metrics, batch


def max_change(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_clip_range_stops_pairs_whose_ratio_already_moved_their_way(tmp_path):
    # The rollout trained twice (as a second inner epoch would): the second pass sees every pair's
    # ratio moved by the first pass toward its advantage (|log ratio| ~ 1e-3 at lr 1e-3), so a 1e-6
    # clip zeroes those pairs' gradient and a clip of 10 keeps them all
    tight, tight_metrics, batch = train_once(tmp_path / "tight", "--diffusion-clip-range 1e-6", passes=2)
    wide, wide_metrics, _ = train_once(tmp_path / "wide", "--diffusion-clip-range 10", batch, passes=2)
    assert tight_metrics["train/ppo_clipfrac"] > 0.0
    assert wide_metrics["train/ppo_clipfrac"] == 0.0
    assert max_change(tight.trained_state(), wide.trained_state()) > 0.0


KL = "--use-ema --ema-decay 0.5 --diffusion-kl-reference ema"


def test_kl_beta_pulls_the_second_step_toward_the_reference(tmp_path):
    # the EMA equals the weights in the first window (no KL gradient); after one step it lags, so
    # a positive beta adds a gradient and the second step lands elsewhere
    free, free_metrics, batch = train_once(tmp_path / "free", f"{KL} --diffusion-kl-beta 0")
    pulled, pulled_metrics, _ = train_once(tmp_path / "pulled", f"{KL} --diffusion-kl-beta 10", batch)
    assert pulled_metrics["train/kl_loss"] > 0.0 and "train/kl_loss" not in free_metrics
    assert max_change(free.trained_state(), pulled.trained_state()) > 0.0


def test_kl_reference_chooses_the_policy_the_kl_is_measured_against(tmp_path):
    # with LoRA and an EMA both present, the LoRA base (adapters off) and the EMA of the adapters
    # are different policies once the adapters have moved
    flags = "--use-lora --lora-rank 4 --use-ema --ema-decay 0.5 --diffusion-kl-beta 10"
    ema, ema_metrics, batch = train_once(tmp_path / "ema", f"{flags} --diffusion-kl-reference ema")
    base, base_metrics, _ = train_once(tmp_path / "base", f"{flags} --diffusion-kl-reference lora_base", batch)
    assert ema_metrics["train/kl_loss"] != base_metrics["train/kl_loss"]
    assert max_change(ema.trained_state(), base.trained_state()) > 0.0


@pytest.mark.parametrize("decay", [0.5, 0.75])
def test_ema_is_kept_at_its_decay_and_saved_with_the_checkpoint(tmp_path, decay):
    # one optimizer step: the shadow is decay * start + (1 - decay) * stepped weights
    rank, _, _ = train_once(tmp_path, f"--use-ema --ema-decay {decay} --num-steps-per-rollout 1")
    assert rank.ema is not None
    start, stepped = rank.start_state, rank.trained_state()
    assert max_change(start, stepped) > 0.0
    for name, shadow in rank.ema.shadow.items():
        expected = decay * start[name].double() + (1 - decay) * stepped[name].double()
        # lerp_ in fp32: a few roundings, each half an ulp of a value no larger than the two ends
        bound = 4 * FP32_EPS * max(float(start[name].abs().max()), float(stepped[name].abs().max()), 1e-30)
        assert float((shadow.double() - expected).abs().max()) <= bound, name
    staging = tmp_path / "ckpt"
    staging.mkdir()
    rank.save(str(staging))
    from miles.backends.checkpoint import load_tensors

    saved = load_tensors(staging / "ema_transformer.safetensors")
    assert all(torch.equal(saved[n.split(".", 1)[1]], t) for n, t in rank.ema.shadow.items())


def lora_velocity_change(rank, batch) -> float:
    """How far the trained adapters move the model's velocity at the first stored step."""
    from miles.backends.lora import adapters_disabled

    t = batch.trajectories[0]
    x, sigma = t.latents[:1], t.sigmas[:1]
    modules = [rank.fmodel.transformers[c] for c in rank.components]
    with torch.no_grad():
        trained = rank.fmodel.velocity(x, sigma, t.cond, t.guidance_scales[0], t.experts[0])
        with adapters_disabled(modules):
            base = rank.fmodel.velocity(x, sigma, t.cond, t.guidance_scales[0], t.experts[0])
    return float((trained - base).double().norm())


def test_lora_alpha_scales_what_the_trained_adapters_add(tmp_path):
    # One step from B = 0: the forward is the base model's whatever alpha, so the gradient of B is
    # exactly (alpha / rank) times one tensor (alpha / rank is a power of two here), and AdamW's first
    # step lr * g / (|g| + eps) is the same B to within eps / |g|. The adapters then add
    # (alpha / rank) * B A x, so doubling alpha doubles the velocity change, up to the model's
    # curvature over a change of order lr = 1e-3 (a second-order term, ~1e-3 relative).
    flags = "--use-lora --lora-rank 4 --num-steps-per-rollout 1"
    low, _, batch = train_once(tmp_path / "low", f"{flags} --lora-alpha 4")
    high, _, _ = train_once(tmp_path / "high", f"{flags} --lora-alpha 8", batch)
    assert (low.lora.alpha, high.lora.alpha) == (4, 8)
    ratio = lora_velocity_change(high, batch) / lora_velocity_change(low, batch)
    assert ratio == pytest.approx(2.0, rel=0.02)


def backward_passes(run_dir, flags: str, batch=None) -> tuple[int, object]:
    """Backward passes one rollout's training runs: a hook torch calls once per backward that
    accumulates into the parameter."""
    args, plan = tiny_args(run_dir, flags)
    batch = batch if batch is not None else one_rollout(args, 0, engine_for(args))
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    count = [0]
    next(iter(rank.fparams.values())).register_post_accumulate_grad_hook(lambda p: count.__setitem__(0, count[0] + 1))
    rank.train(batch)
    return count[0], batch


def test_micro_batch_size_sets_the_pairs_per_backward_pass(tmp_path):
    # 4 samples x 1 trained step = 4 pairs in one optimizer step; a flat micro-batch of m pairs is
    # m samples at that step, one engine forward when the engines sample in microgroups of m
    import dataclasses

    flags = "--diffusion-num-sde-steps 1 --num-steps-per-rollout 1"
    args, _ = tiny_args(tmp_path / "rollout", flags)
    batch = dataclasses.replace(one_rollout(args, 0, engine_for(args)), trained_steps=[0])  # it recorded steps 0, 1
    ones, _ = backward_passes(tmp_path / "1", f"{flags} --rollout-microgroup-size 1 --micro-batch-size 1", batch)
    twos, _ = backward_passes(tmp_path / "2", f"{flags} --rollout-microgroup-size 2 --micro-batch-size 2", batch)
    assert (ones, twos) == (4, 2)


def epoch_args(run_dir, flags: str):
    """The tiny run over --num-epoch 1 instead of --num-rollout 2."""
    from dtype_helpers import TINY, DEVICE  # noqa: F401
    from miles.flags.arguments import parse_and_plan

    checkpoint, prompts = tiny_assets()
    tiny = TINY.replace("--num-rollout 2", "")
    argv = (f"--hf-checkpoint {checkpoint} --prompt-data {prompts} --run-dir {run_dir} {tiny} "
            f"--actor-num-gpus-per-node 1 --num-gpus-per-node 2 {flags}")
    return parse_and_plan(argv.split())


def lr_after_one_rollout(run_dir, flags: str, batch) -> float:
    args, plan = epoch_args(run_dir, flags) if "--num-epoch" in flags else tiny_args(run_dir, flags)
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    return rank.train(batch).metrics["train/lr"]  # the rate the rank's last optimizer step used


@pytest.mark.parametrize("run_length, rollouts", [("--num-rollout 4", lambda n: 4),
                                                   ("--num-epoch 1", lambda n: -(-n // 2))])
def test_lr_decay_style_and_min_lr_shape_the_rate_over_the_whole_run(tmp_path, run_length, rollouts):
    import math

    args, _ = tiny_args(tmp_path / "sample")
    batch = one_rollout(args, 0, engine_for(args))
    prompts = sum(1 for line in open(args.prompt_data) if line.strip())
    total = rollouts(prompts) * 2  # 2 optimizer steps per rollout; the second used step index 1
    peak, floor = 1e-3, 1e-4
    seen = {style: lr_after_one_rollout(tmp_path / style, f"{run_length} --lr-decay-style {style} {extra}", batch)
            for style, extra in (("constant", ""), ("linear", f"--min-lr {floor}"), ("cosine", f"--min-lr {floor}"))}
    assert seen["constant"] == peak
    assert seen["linear"] == pytest.approx(peak + (floor - peak) * (1 / total), rel=1e-12)
    assert seen["cosine"] == pytest.approx(floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi / total)), rel=1e-12)
    no_floor = lr_after_one_rollout(tmp_path / "nofloor", f"{run_length} --lr-decay-style linear", batch)
    assert no_floor == pytest.approx(peak * (1 - 1 / total), rel=1e-12)
