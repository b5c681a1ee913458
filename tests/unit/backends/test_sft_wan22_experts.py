"""SFT on Wan2.2: each pair's sigma picks the expert that owns it, and only that expert learns."""

import pytest
import torch

from miles.backends.actor import TrainRank
from miles.backends.sft import SFTSource
from miles.proxy_assets.checkpoint import ensure_checkpoint
from miles.models.runtime import configure_torch
from miles.proxy_assets.prompts import ensure_sft_dataset
from miles.plan.command_line import parse_command_line
from miles.flags.batching import Pair


@pytest.fixture(scope="module")
def rank(tmp_path_factory):
    configure_torch(num_threads=1)
    root = tmp_path_factory.mktemp("sft-wan")
    checkpoint = ensure_checkpoint("wan2_2", "tiny", 0, root)
    data = ensure_sft_dataset(root / "sft.jsonl", "wan2_2", 2, 32, 32, 5)
    argv = (f"--hf-checkpoint {checkpoint} --prompt-data {data} --loss-type sft_loss --train-only "
            f"--rollout-batch-size 2 --n-samples-per-prompt 1 --num-rollout 1 --diffusion-height 32 "
            f"--diffusion-width 32 --diffusion-output-num-frames 5 --diffusion-num-steps 6 --diffusion-num-sde-steps 2 "
            f"--diffusion-step-strategy-path epoch_global_random_choice --diffusion-guidance-scale 4.0 "
            f"--diffusion-guidance-scale-2 3.0 --micro-batch-size-sample 2 --micro-batch-size-tstep 1 "
            f"--use-lora --lora-rank 4 --device cpu --actor-num-gpus-per-node 1 --num-gpus-per-node 1 "
            f"--run-dir {root / 'run'}").split()
    args, plan = parse_command_line(argv)
    train_rank = TrainRank(args, plan, 0, 1)
    train_rank.setup()
    return train_rank


def _grads_by_expert(rank, step):
    rank.optimizer.zero_grad(set_to_none=True)
    batch, _ = SFTSource(rank.args).generate(0)
    sigmas = rank.model.sigmas(rank.args.diffusion_num_steps, rank.args.diffusion_shift)
    rank.sft.micro_batch_loss(batch, [Pair(0, step), Pair(1, step)], sigmas).backward()
    out = {}
    for name, p in rank.params.items():
        component = name.split(".", 1)[0]
        out[component] = out.get(component, 0.0) + (0.0 if p.grad is None else float(p.grad.abs().sum()))
    rank.optimizer.zero_grad(set_to_none=True)
    return out, rank.model.expert_for(sigmas[step])


def test_each_sigma_trains_only_its_expert(rank):
    assert set(rank.components) == {"transformer", "transformer_2"}
    # step 0 (sigma 1) is high noise; the last step of a shifted 6-step schedule is below the boundary
    for step, owner, other in ((0, "transformer", "transformer_2"), (5, "transformer_2", "transformer")):
        grads, expert = _grads_by_expert(rank, step)
        assert expert == owner
        assert grads[owner] > 0 and grads[other] == 0, (step, grads)
