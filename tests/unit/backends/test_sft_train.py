"""SFT on the tiny sd3 checkpoint, in process: the flow-matching loss falls, ranks train their shard."""

import pytest
import torch

from miles.backends.actor import TrainRank
from miles.backends.sft import SFTBatch, SFTSource, pair_noise
from miles.proxy_assets.prompts import ensure_sft_dataset
from miles.plan.command_line import parse_command_line
from miles.flags.batching import Pair


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("sft-assets")
    checkpoint = tiny_checkpoint("sd3")
    data = ensure_sft_dataset(root / "sft.jsonl", "sd3", 4, 32, 32, 1)
    return checkpoint, data


def _args(assets, tmp_path, *extra):
    checkpoint, data = assets
    argv = (f"--hf-checkpoint {checkpoint} --prompt-data {data} --loss-type sft_loss --train-only "
            f"--rollout-batch-size 4 --n-samples-per-prompt 1 --num-rollout 12 "
            f"--diffusion-height 32 --diffusion-width 32 --diffusion-num-steps 4 --diffusion-num-sde-steps 2 "
            f"--diffusion-step-strategy-path epoch_global_random_choice --num-steps-per-rollout 1 "
            f"--micro-batch-size 4 --lr 2e-3 --device cpu --actor-num-gpus-per-node 1 --num-gpus-per-node 1 "
            f"--deterministic-mode --run-dir {tmp_path / 'run'}").split() + list(extra)
    return parse_command_line(argv)


def _fixed_loss(rank, source_args) -> float:
    """The loss on a fixed set of items, timesteps and noise (no optimizer step)."""
    items = SFTSource(source_args).dataset.items
    batch = SFTBatch(rollout_id=10_000, items=items, n_samples_per_prompt=1, trained_steps=[0, 1, 2, 3])
    sigmas = rank.model.sigmas(source_args.diffusion_num_steps, source_args.diffusion_shift)
    pairs = [Pair(s, t) for s in range(len(items)) for t in range(4)]
    with torch.no_grad():
        return float(rank.sft.micro_batch_loss(batch, pairs, sigmas))


def test_sft_loss_decreases_on_tiny_sd3(assets, tmp_path):
    args, plan = _args(assets, tmp_path)
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    assert "text_encoder" in rank.model.text_encoders  # SFT keeps the text encoder
    source = SFTSource(args)
    before = _fixed_loss(rank, args)
    losses = []
    for rollout_id in range(args.num_rollout):
        batch, _ = source.generate(rollout_id)
        result = rank.train(batch)
        assert len(result.shard) == plan.pairs_per_rank
        assert result.metrics["train/grad_norm"] > 0
        losses.append(result.metrics["train/loss"])
    after = _fixed_loss(rank, args)
    # measured 1.662 -> 1.356 (-18 %) on the pipeline's own sigma schedule; no training: +-0 %
    assert after < 0.9 * before, (before, after, losses)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    # the VAE and text encoder stay frozen
    assert not any(p.requires_grad for p in rank.model.vae.parameters())
    assert not any(p.requires_grad for m in rank.model.text_encoders.values() for p in m.parameters())


def test_sft_with_lora_trains_only_adapters(assets, tmp_path):
    args, plan = _args(assets, tmp_path, "--use-lora", "--lora-rank", "4")
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    assert rank.params and all(".lora_" in n for n in rank.params)
    start = {n: p.detach().clone() for n, p in rank.params.items()}
    batch, _ = SFTSource(args).generate(0)
    rank.train(batch)
    changed = [n for n, p in rank.params.items() if not torch.equal(p, start[n])]
    assert changed and all(".lora_" in n for n in changed)


def test_noise_and_data_position_are_functions_of_the_seed(assets, tmp_path):
    args, _ = _args(assets, tmp_path)
    a = pair_noise(1, 2, Pair(3, 1), (4, 4, 4))
    assert torch.equal(a, pair_noise(1, 2, Pair(3, 1), (4, 4, 4)))
    assert not torch.equal(a, pair_noise(1, 2, Pair(3, 0), (4, 4, 4)))
    source = SFTSource(args)
    source.generate(0)
    resumed = SFTSource(args)
    resumed.load_state_dict(source.state_dict())
    assert [i.index for i in resumed.generate(1)[0].items] == [i.index for i in source.generate(1)[0].items]
