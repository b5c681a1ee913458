"""--compute-dtype: master weights in --param-dtype, forwards in the compute dtype, engines in --rollout-dtype."""

from __future__ import annotations

import pytest
import torch

from miles.flags.arguments import ConfigError, parse_args

BF16 = "--compute-dtype bfloat16 --rollout-dtype bfloat16 --param-dtype float32"


def test_bf16_compute_keeps_parity_exact_with_fp32_master_weights(tmp_path):
    from dtype_helpers import engine_for, one_rollout, tiny_args

    from miles.backends.actor import TrainRank
    from miles.rollout.data import PromptDataset

    args, plan = tiny_args(tmp_path, BF16 + " --use-lora --lora-rank 4")
    engine, dataset = engine_for(args), PromptDataset.from_args(args)
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    engine.apply_lora(rank.lora.rank, rank.lora.alpha, list(rank.lora.target_modules), rank.components)
    assert {p.dtype for p in rank.params.values()} == {torch.float32}  # the optimizer's master weights
    assert {p.dtype for p in rank.fparams.values()} == {torch.bfloat16}  # what forwards run on
    start = {n: p.detach().clone() for n, p in rank.params.items()}
    for rollout_id in range(2):  # the second rollout is sampled on weights the trainer pushed
        metrics = rank.train(one_rollout(args, rollout_id, engine, dataset)).metrics
        assert metrics["train/model_output_max_abs_diff"] == 0.0, (rollout_id, metrics)
        assert metrics["train/log_prob_abs_diff"] == 0.0
        for update in rank.weight_updates():
            assert {t.dtype for t in update.state_dict.values()} == {torch.bfloat16}  # engines get --rollout-dtype
            engine.load_weights(update.component, update.state_dict)
    changed = [n for n, p in rank.params.items() if not torch.equal(p, start[n])]
    assert changed
    # the compute copy is the master rounded to bf16, as an engine rounds what it receives
    for name in changed:
        assert torch.equal(rank.fparams[name], rank.params[name].detach().to(torch.bfloat16))
    # some of the step lives below bf16 resolution: only fp32 master weights keep it
    assert any(not torch.equal(rank.params[n], rank.params[n].to(torch.bfloat16).float()) for n in changed)


ARGV = "--hf-checkpoint /ckpt/sd3 --num-rollout 1 --rm-type brightness --prompt-data p.jsonl"


@pytest.mark.parametrize("flags, message", [
    ("--compute-dtype bfloat16", "--compute-dtype bfloat16 with --rollout-dtype float32: .* parity .* cannot be exact; "
                                 "fix: --rollout-dtype bfloat16"),
    ("--rollout-dtype bfloat16", "fix: --rollout-dtype float32 \\(or --compute-dtype bfloat16\\)"),
    ("--param-dtype bfloat16", "--param-dtype bfloat16 with --compute-dtype float32: .* fix: --param-dtype float32"),
    ("--param-dtype float16 --compute-dtype bfloat16 --rollout-dtype bfloat16", "fix: --param-dtype float32"),
])
def test_dtype_combinations_without_exact_parity_are_refused_naming_the_fix(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(f"{ARGV} {flags}".split())


def test_dtype_combinations_with_exact_parity_are_accepted():
    for flags in ("", BF16, "--param-dtype bfloat16 --compute-dtype bfloat16 --rollout-dtype bfloat16"):
        parse_args(f"{ARGV} {flags}".split())
    # no engines (SFT): the rollout dtype does not matter
    parse_args(f"{ARGV} --loss-type sft_loss --train-only --compute-dtype bfloat16 --n-samples-per-prompt 1".split())
