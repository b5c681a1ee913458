"""Flags whose effect is a value handed to the part that uses it: each reaches that part.

The end-to-end effect of these values is tested where the part is (sampler, SDE step, loss,
optimizer); what is asserted here is that the parsed flag, not a default, is what the part gets.
"""

from __future__ import annotations

import torch

from miles.flags.arguments import parse_args

ARGV = "--hf-checkpoint /ckpt/sd3 --num-rollout 1 --rm-type brightness --prompt-data p.jsonl --device cpu"


def args_with(flags: str):
    return parse_args(f"{ARGV} {flags}".split())


def test_optimizer_flags_reach_adamw():
    from miles.backends.optimizer import build_optimizer

    args = args_with("--lr 3e-4 --adam-beta1 0.8 --adam-beta2 0.95 --adam-eps 1e-6 --weight-decay 0.01")
    group = build_optimizer([torch.nn.Parameter(torch.zeros(2))], args).param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.01)


def test_sampling_flags_reach_the_engine():
    from miles.rollout.types import SamplingParams

    args = args_with("--diffusion-guidance-scale 2.5 --diffusion-height 96 --diffusion-width 128 "
                     "--diffusion-output-num-frames 3 --diffusion-noise-level 0.5 --diffusion-sde-type ode "
                     "--negative-prompt blurry --diffusion-num-steps 6 --diffusion-num-sde-steps 6 "
                     "--diffusion-max-sequence-length 64")
    p = SamplingParams.from_args(args)
    assert (p.guidance_scale, p.height, p.width, p.num_frames, p.noise_level, p.sde_type, p.negative_prompt,
            p.num_steps, p.max_sequence_length) == (2.5, 96, 128, 3, 0.5, "ode", "blurry", 6, 64)


def test_algorithm_flags_reach_the_loss_and_the_advantages(monkeypatch):
    import miles.ray.rollout_manager as rm
    from miles.backends import loss
    from miles.rollout.types import StoredSample

    seen = {}

    def spy(rewards, n, **kw):
        seen.update(kw)
        return loss.compute_advantages(rewards, n, **kw)

    monkeypatch.setattr(rm, "compute_advantages", spy)
    args = args_with("--diffusion-adv-clip-max 2.0 --globalize-reward-mean --globalize-reward-std "
                     "--advantage-estimator grpo --n-samples-per-prompt 2 --rollout-batch-size 1")
    manager = rm.RolloutManager.__new__(rm.RolloutManager)
    manager.args, manager.train_plan = args, None
    manager.dataset = type("D", (), {"next_batch": lambda self, n: [type("I", (), {"prompt": "p", "metadata": {}})()]})()
    manager._sample = lambda requests, steps, evaluation, train: [
        StoredSample(r.group_index, r.sample_index, reward_input=None, num_steps=4) for r in requests]
    manager.rewards = type("R", (), {"score_stored": lambda self, refs: [0.0, 1.0]})()
    manager.generate(0)
    assert seen == {"globalize_mean": True, "globalize_std": True, "adv_clip_max": 2.0, "estimator": "grpo"}
    assert loss.ADVANTAGE_ESTIMATORS == ("grpo",)


def test_clip_range_and_nft_beta_change_the_loss():
    from miles.backends.loss import NFTInputs, PolicyLossInputs, nft_loss, policy_loss

    inputs = PolicyLossInputs(torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([1.0]),
                              torch.zeros(1, 2), torch.ones(1), None)
    assert float(policy_loss(inputs, clip_range=0.1, kl_beta=0.0)[0]) != float(policy_loss(inputs, clip_range=0.9, kl_beta=0.0)[0])
    nft = NFTInputs(torch.ones(1, 2), torch.zeros(1, 2), torch.full((1, 2), 0.5), torch.zeros(1, 2),
                    torch.tensor([0.5]), torch.tensor([1.0]))
    assert float(nft_loss(nft, beta=1.0, adv_clip_max=5.0)[0]) != float(nft_loss(nft, beta=0.5, adv_clip_max=5.0)[0])
