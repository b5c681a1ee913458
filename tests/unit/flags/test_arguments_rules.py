"""Every validation rule: what it accepts, what it refuses, and the one-line message with the fix."""

from __future__ import annotations

import re

import pytest

from miles.flags.arguments import ConfigError, parse_args, validate_argv

BASE = ["--hf-checkpoint", "/ckpt/sd3-tiny", "--num-rollout", "2", "--rm-type", "brightness",
        "--prompt-data", "prompts.jsonl"]
# Wan2.2 at 10 steps, shift 12: steps 0..6 on `transformer`, 7..9 on `transformer_2`.
WAN = ["--hf-checkpoint", "/ckpt/wan2.2-tiny", "--num-rollout", "2", "--rm-type", "brightness",
       "--prompt-data", "prompts.jsonl", "--diffusion-guidance-scale-2", "3.0"]
# the same without rollouts: SFT (no rollout tile), where only the batch arithmetic decides a layout
SFT = [a for a in BASE if a not in ("--rm-type", "brightness")] + ["--loss-type", "sft_loss"]
WAN_SFT = [a for a in WAN if a not in ("--rm-type", "brightness")] + ["--loss-type", "sft_loss"]
# 32 prompts x 16 samples, 2 SDE steps, 4 DP ranks: 1024 pairs, 256 per rank.
WORKED = ["--rollout-batch-size", "32", "--n-samples-per-prompt", "16", "--diffusion-num-sde-steps", "2",
          "--actor-num-gpus-per-node", "4", "--colocate"]


def plan(*extra, base=BASE):
    return validate_argv([*base, *extra])


def refused(match, *extra, base=BASE) -> str:
    with pytest.raises(ConfigError) as error:
        validate_argv([*base, *extra])
    message = str(error.value)
    assert re.search(match, message), message
    assert "\n" not in message
    return message


def test_worked_example_of_the_design_gives_its_counts():
    p = plan(*WORKED, "--num-steps-per-rollout", "2", "--micro-batch-size-sample", "8",
             "--micro-batch-size-tstep", "1", "--rollout-microgroup-size", "8",
             base=BASE[:1] + ["/ckpt/qwen-image"] + BASE[2:])
    assert (p.samples_per_rollout, p.train_pairs, p.dp_size) == (512, 1024, 4)
    assert (p.pairs_per_rank, p.pairs_per_step_per_rank) == (256, 128)
    assert (p.pairs_per_forward, p.forwards_per_step, p.global_batch_size) == (8, 16, 256)


# ---- the trajectory-level invariant ----

def test_num_steps_per_rollout_derives_the_global_batch_size():
    ns = parse_args(BASE + ["--num-steps-per-rollout", "4"])
    assert (ns.global_batch_size, ns.num_steps_per_rollout) == (64, 4)


def test_global_batch_size_derives_the_num_steps_per_rollout():
    ns = parse_args(BASE + ["--global-batch-size", "32"])
    assert (ns.global_batch_size, ns.num_steps_per_rollout) == (32, 8)


def test_neither_batch_knob_means_one_optimizer_step_per_rollout():
    ns = parse_args(BASE)
    assert (ns.global_batch_size, ns.num_steps_per_rollout) == (256, 1)


def test_consistent_global_batch_size_and_steps_are_accepted_together():
    assert plan("--global-batch-size", "64", "--num-steps-per-rollout", "4").num_steps_per_rollout == 4


def test_contradicting_global_batch_size_and_steps_abort():
    refused(r"--global-batch-size 64 x --num-steps-per-rollout 2 = 128 contradicts samples per rollout=256 "
            r".*fix: set only one", "--global-batch-size", "64", "--num-steps-per-rollout", "2")


def test_global_batch_size_that_does_not_divide_the_samples_is_refused():
    refused(r"samples per rollout=256 .* not divisible by --global-batch-size 48; fix",
            "--global-batch-size", "48")


def test_steps_per_rollout_that_split_a_sample_across_steps_are_refused():
    # 6 samples x 2 pairs = 12 pairs split into 4 steps of 3, but 6 samples do not make 4 equal steps
    refused(r"not divisible by --num-steps-per-rollout 4, so an optimizer step would hold 1.5 samples",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--diffusion-num-sde-steps", "2",
            "--num-steps-per-rollout", "4")


def test_global_batch_size_not_divisible_by_dp_size_is_refused():
    refused(r"global_batch_size=2 not divisible by dp_size=4; fix", *WORKED, "--global-batch-size", "2")


def test_pair_shard_rule_gives_the_exact_message_and_the_fix():
    message = refused(r"^num_pairs_shard=256 not divisible by num_steps_per_rollout=3; fix: adjust "
                      r"--rollout-batch-size, --n-samples-per-prompt or --num-steps-per-rollout",
                      *WORKED, "--num-steps-per-rollout", "3")
    assert "num_pairs_shard=N" not in message


def test_pairs_that_do_not_deal_to_the_dp_ranks_are_refused():
    refused(r"train pairs=6 .* not divisible by dp_size=4", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "2", "--diffusion-num-sde-steps", "1", "--actor-num-gpus-per-node", "4")


def test_dp_size_is_the_train_ranks_with_sequence_parallel_size_1():
    assert plan(*WORKED, "--sequence-parallel-size", "1").dp_size == 4


@pytest.mark.parametrize("size", ["2", "3"])
def test_sequence_parallel_size_other_than_1_is_refused(size):
    refused(rf"--sequence-parallel-size {size}: sequence parallelism is not implemented; use 1", *WORKED,
            "--sequence-parallel-size", size)


# ---- micro-batching ----

def test_unset_micro_batch_flags_give_the_rollout_tile_and_the_plan_states_it():
    ns = parse_args(BASE + ["--rollout-microgroup-size", "4"])
    p = validate_argv(BASE + ["--rollout-microgroup-size", "4"])
    assert (p.rollout_tile_samples, p.pairs_per_forward, p.micro_batching.tile_steps) == (4, 4, 1)
    assert (ns.micro_batch_size_sample, ns.micro_batch_size_tstep) == (4, 1)  # written back: re-validating is a no-op
    assert re.search(r"rollout tile\s+4 samples \(one microgroup\) x 1 timestep", p.table())


@pytest.mark.parametrize("flags, fix", [
    (["--micro-batch-size", "2"], "--micro-batch-size-sample 8 --micro-batch-size-tstep 1"),
    (["--micro-batch-size-sample", "4", "--micro-batch-size-tstep", "1"],
     "--rollout-microgroup-size 4 --micro-batch-size-tstep 1"),
    (["--diffusion-num-sde-steps", "2", "--micro-batch-size-sample", "8", "--micro-batch-size-tstep", "2"],
     "--rollout-microgroup-size 8 --micro-batch-size-tstep 1"),
    (["--diffusion-num-sde-steps", "1", "--micro-batch-size", "4"],
     "--micro-batch-size-sample 8 --micro-batch-size-tstep 1"),
])
def test_a_micro_batch_that_is_no_engine_forward_is_refused_naming_the_flags_and_a_layout_that_is(flags, fix):
    message = refused(r"--micro-batch-size.*cannot reproduce the engines' forwards.*--rollout-microgroup-size 8 "
                      r"samples at one timestep.*fix: ", *flags)
    assert fix in message
    if f"{fix} (in place of --micro-batch-size" in message:  # a tile replaces the flat size, which it refuses beside it
        at = flags.index("--micro-batch-size")
        flags = flags[:at] + flags[at + 2:]
    plan(*flags, *fix.split(" (")[0].split())  # the fix it names is accepted


def test_a_default_rollout_tile_that_does_not_fit_an_optimizer_step_names_one_that_does():
    # 2 ranks, 2 optimizer steps: a rank's step holds one sample at 2 timesteps, no microgroup of 2
    message = refused(r"^the rollout tile \(no micro-batch flags: one microgroup of --rollout-microgroup-size 2 "
                      r"samples x 1 timestep per forward\) does not fit: .*1 samples x 2 timesteps",
                      "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--diffusion-num-sde-steps", "2",
                      "--num-steps-per-rollout", "2", "--actor-num-gpus-per-node", "2", "--colocate")
    assert message.endswith("fix: --rollout-microgroup-size 1 --micro-batch-size 1")


def test_stride_split_that_scatters_a_microgroup_is_refused_with_the_contiguous_fix():
    # 4 ranks deal 32 pairs round-robin: a rank's samples at a step are every other one of a prompt
    message = refused(r"not microgroup", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                      "--diffusion-num-sde-steps", "1", "--actor-num-gpus-per-node", "2", "--colocate",
                      "--train-dp-split-mode", "stride")
    assert message.endswith("--micro-batch-size-sample 4 --micro-batch-size-tstep 1 --train-dp-split-mode contiguous")


def test_sft_has_no_rollout_tile_and_keeps_one_pair_per_forward_by_default():
    p = plan("--loss-type", "sft_loss", "--n-samples-per-prompt", "1", base=[a for a in BASE if a not in (
        "--rm-type", "brightness")])
    assert (p.rollout_tile_samples, p.pairs_per_forward) == (0, 1)
    assert "rollout tile" not in p.table()

def test_a_flat_micro_batch_size_beside_a_2d_tile_is_refused_as_having_no_effect():
    refused(r"--micro-batch-size 3 has no effect beside the 2D tile --micro-batch-size-sample 8 "
            r"--micro-batch-size-tstep 2.*fix: change the tile flags instead, or drop --micro-batch-size",
            *WORKED, "--micro-batch-size", "3", "--micro-batch-size-sample", "8", "--micro-batch-size-tstep", "2")
    p = plan(*WORKED, "--micro-batch-size-sample", "16", "--micro-batch-size-tstep", "1")  # the tile alone sets it
    assert (p.pairs_per_forward, p.forwards_per_step) == (16, 16)


@pytest.mark.parametrize("flag", ["--micro-batch-size-sample", "--micro-batch-size-tstep"])
def test_2d_tile_needs_both_sizes(flag):
    refused(r"a 2D tile needs both; fix: set both, or neither", flag, "2")


def test_flat_micro_batch_must_divide_the_pairs_of_an_optimizer_step():
    refused(r"pairs per optimizer step per rank=256 not divisible by micro_batch_size=3; fix: pick a "
            r"--micro-batch-size", *WORKED, "--micro-batch-size", "3")


def test_2d_tile_must_divide_the_samples_and_timesteps_of_an_optimizer_step():
    refused(r"window of 128 samples x 2 timesteps does not tile into 8 x 3", *WORKED,
            "--micro-batch-size-sample", "8", "--micro-batch-size-tstep", "3")


def test_2d_tile_of_a_stride_shard_that_is_no_grid_is_refused():
    # 3 ranks deal 6 samples x 2 steps round-robin: rank 0 gets (0,0), (1,1), (3,0), (4,1)
    refused(r"not a full samples x timesteps grid.*--train-dp-split-mode contiguous",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--diffusion-num-sde-steps", "2",
            "--actor-num-gpus-per-node", "3", "--train-dp-split-mode", "stride",
            "--micro-batch-size-sample", "1", "--micro-batch-size-tstep", "1")


def test_stride_split_with_2d_tiles_gives_each_rank_whole_timesteps():
    p = plan(*WORKED, "--train-dp-split-mode", "stride", "--micro-batch-size-sample", "16",
             "--micro-batch-size-tstep", "1", base=SFT)
    assert (p.pairs_per_rank, p.forwards_per_step) == (256, 16)


# ---- the step strategy ----

def test_trained_steps_default_to_the_reference_fraction_never_the_terminal_step():
    # flow_grpo's int(num_steps * timestep_fraction) with its 0.99: steps 0..4 of 6, not step 5
    ns = parse_args(BASE + ["--diffusion-num-steps", "6"])
    assert ns.diffusion_num_sde_steps == 5
    assert plan("--diffusion-num-steps", "6").train_pairs == 256 * 5
    assert parse_args(BASE + ["--diffusion-num-steps", "6", "--diffusion-timestep-fraction", "1.0"]).diffusion_num_sde_steps == 6
    assert parse_args(BASE + ["--diffusion-num-steps", "10", "--diffusion-nft-timestep-fraction", "0.5"]).diffusion_num_sde_steps == 5


def test_random_step_choice_draws_from_the_reference_fraction():
    import random
    from types import SimpleNamespace

    from miles.rollout.step_strategy import epoch_global_random_choice

    args = SimpleNamespace(diffusion_timestep_fraction=0.99)
    drawn = {s for seed in range(200) for s in epoch_global_random_choice(args, 0, 10, 3, random.Random(seed))}
    assert drawn == set(range(9))  # every step but the terminal one comes up
    args.diffusion_timestep_fraction = 1.0
    drawn = {s for seed in range(200) for s in epoch_global_random_choice(args, 0, 10, 3, random.Random(seed))}
    assert 9 in drawn


@pytest.mark.parametrize("flags, message", [
    (["--ema-rollout-policy", "ema"], "--ema-rollout-policy ema with --loss-type policy_loss"),
    (["--loss-type", "nft", "--train-backend", "fsdp"], "--ema-rollout-policy ema with --train-backend fsdp"),
    (["--ema-decay-max", "0.9"], "--ema-decay-max shape the old policy's decay"),
    (["--loss-type", "nft", "--ema-rollout-policy", "live", "--ema-decay-ramp", "0.01"], "--ema-decay-ramp shape"),
    (["--no-diffusion-nft-adaptive-weight"], "--no-diffusion-nft-adaptive-weight with --loss-type policy_loss"),
    (["--loss-type", "nft", "--keep-zero-advantage-samples"], "--keep-zero-advantage-samples with --loss-type nft"),
    (["--lora-init-weights", "kaiming-uniform"], "--lora-init-weights given without --use-lora"),
])
def test_algorithm_flags_that_would_do_nothing_are_refused(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(BASE + flags)


def test_loss_dependent_defaults_are_the_references():
    assert parse_args(BASE).diffusion_kl_beta == 0.0 and parse_args(BASE).ema_rollout_policy == "live"
    nft = parse_args(BASE + ["--loss-type", "nft", "--use-lora"])
    assert nft.diffusion_kl_beta == 1e-4 and nft.ema_rollout_policy == "ema"  # DiffusionNFT's train.beta
    assert parse_args(BASE + ["--loss-type", "nft"]).diffusion_kl_beta == 0.0  # no LoRA base to compare with
    aliases = parse_args(BASE + ["--loss-type", "nft", "--diffusion-nft-beta", "0.3", "--ref-mode", "ema", "--use-ema"])
    assert aliases.nft_beta == 0.3 and aliases.diffusion_kl_reference == "ema"


def test_more_sde_steps_than_denoising_steps_is_refused():
    refused(r"--diffusion-num-sde-steps 5 > --diffusion-num-steps 4", "--diffusion-num-steps", "4",
            "--diffusion-num-sde-steps", "5")


def test_sde_window_must_fit_in_the_schedule():
    refused(r"max-start 9 \+ .* 2 > --diffusion-num-steps 10; fix: lower the max start to 8",
            "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-max-start", "9")


def test_window_max_start_belongs_to_sde_window_only():
    refused(r"applies to the sde_window strategy only", "--diffusion-num-sde-steps", "2",
            "--diffusion-sde-window-max-start", "1", "--diffusion-step-strategy-path", "epoch_global_random_choice")


@pytest.mark.parametrize("path", ["my_pkg.strategies:pick", "my_pkg.strategies.pick"])
def test_custom_step_strategy_is_a_dotted_path(path):
    assert plan("--diffusion-step-strategy-path", path).step_strategy == path


def test_step_strategy_that_is_no_path_is_refused():
    refused(r"'window' is neither sde_window nor epoch_global_random_choice", "--diffusion-step-strategy-path", "window")


# ---- Wan2.2 ----

def test_wan22_flat_micro_batch_across_the_expert_boundary_is_refused_with_the_exact_message():
    message = refused(r"^Micro-batch mixes denoising phases \(Wan2\.2\).*fix: --micro-batch-size 1 or a "
                      r"phase-pure tiling", "--diffusion-num-steps", "8", "--diffusion-timestep-fraction", "1.0",
                      "--micro-batch-size", "2", base=WAN)
    assert "steps [4, 5]" in message  # the pipeline's 8-step schedule at shift 12: 0..4 high-noise


def test_wan22_flat_micro_batch_of_one_is_accepted():
    assert plan("--micro-batch-size", "1", base=WAN_SFT).pairs_per_forward == 1


def test_wan22_flat_pairs_that_stay_on_one_side_are_accepted():
    # steps 0..1 of a 2-step window at start 0 are both high-noise
    assert plan("--diffusion-num-sde-steps", "2", "--micro-batch-size", "2", base=WAN_SFT).pairs_per_forward == 2


def test_wan22_every_window_start_is_checked():
    # starts 0..4 stay before step 6; start 5 puts steps 5 and 6 in one forward
    assert plan("--diffusion-num-sde-steps", "2", "--diffusion-sde-window-max-start", "4",
                "--micro-batch-size", "2", base=WAN_SFT)
    refused(r"Micro-batch mixes denoising phases \(Wan2\.2\).*steps \[5, 6\]", "--diffusion-num-sde-steps", "2",
            "--diffusion-sde-window-max-start", "5", "--micro-batch-size", "2", base=WAN)


def test_wan22_one_timestep_tiles_are_phase_pure():
    p = plan("--micro-batch-size-sample", "8", "--micro-batch-size-tstep", "1", base=WAN)
    assert p.pairs_per_forward == 8


def test_wan22_random_step_choice_is_checked_conservatively():
    refused(r"Micro-batch mixes denoising phases", "--diffusion-num-sde-steps", "2", "--micro-batch-size", "2",
            "--diffusion-step-strategy-path", "epoch_global_random_choice", base=WAN)


@pytest.mark.parametrize("strategy", ["epoch_global_random_choice", "my_pkg.pick"])
def test_wan22_choice_of_every_step_is_checked_as_the_one_choice_it_is(strategy):
    # 10 steps at shift 12 (the pipeline's schedule): steps 0..5 high-noise, 6..9 low. Choosing all
    # 10 (sorted by the rollout) leaves one choice, and flat pairs (0,1) .. (8,9) never straddle step 6.
    assert plan("--diffusion-num-steps", "10", "--diffusion-timestep-fraction", "1.0", "--micro-batch-size", "2",
                "--diffusion-step-strategy-path", strategy, base=WAN_SFT)


def test_wan22_custom_strategy_mixing_two_steps_is_refused():
    refused(r"Micro-batch mixes denoising phases", "--diffusion-num-sde-steps", "2", "--micro-batch-size", "2",
            "--diffusion-step-strategy-path", "my_pkg.pick", base=WAN)


def test_wan22_shift_moves_the_boundary():
    # shift 1: steps 0..1 high-noise, so a 2-step window at start 0 is pure, at 1 it mixes
    refused(r"steps \[1, 2\]", "--diffusion-shift", "1.0", "--diffusion-num-sde-steps", "2",
            "--diffusion-sde-window-max-start", "1", "--micro-batch-size", "2", base=WAN)


def test_wan22_plan_names_the_expert_of_every_trainable_step():
    p = plan("--diffusion-num-sde-steps", "2", "--diffusion-sde-window-max-start", "6", base=WAN)
    assert p.trainable_steps == tuple(range(8))
    assert [p.expert_for_step(s) for s in (5, 6)] == ["transformer", "transformer_2"]
    assert "step 6 (sigma" in p.table() and "trains transformer_2" in p.table()


def test_wan22_needs_guidance_scale_2_when_the_low_noise_expert_runs():
    refused(r"--diffusion-guidance-scale-2 is required: the run samples steps 6..9 on the low-noise "
            r"expert transformer_2; fix", "--diffusion-num-sde-steps", "2", base=WAN[:-2])


def test_wan22_needs_guidance_scale_2_when_the_low_noise_expert_trains():
    refused(r"--diffusion-guidance-scale-2 is required: the run trains", "--loss-type", "sft_loss",
            "--train-only", base=WAN[:-2])


def test_wan22_sft_on_high_noise_steps_only_needs_no_second_scale():
    assert plan("--loss-type", "sft_loss", "--train-only", "--diffusion-num-sde-steps", "2", base=WAN[:-2])


def test_second_guidance_scale_on_a_one_expert_family_is_refused():
    refused(r"--diffusion-guidance-scale-2 given but sd3 has one expert", "--diffusion-guidance-scale-2", "3")


# ---- the GPU layout ----

def test_layout_needing_more_gpus_than_the_job_has_is_refused():
    refused(r"the GPU layout needs 10 GPUs \(train 8 = 1 x 8, rollout 1, reward 1 = 4 x 0.25\) but the job "
            r"has 8 \(--num-nodes 1 x --num-gpus-per-node 8\); fix", "--actor-num-gpus-per-node", "8",
            "--rm-num-workers", "4", "--rm-num-gpus-per-worker", "0.25")


def test_colocated_rollout_shares_the_train_gpus():
    ns = parse_args(BASE + ["--actor-num-gpus-per-node", "4", "--colocate", "--rm-num-gpus-per-worker", "1",
                            "--num-gpus-per-node", "5"])
    assert ns.rollout_num_gpus == 4


def test_rollout_gpus_default_to_one_without_colocate():
    assert parse_args(BASE).rollout_num_gpus == 1


def test_colocated_rollout_cannot_exceed_the_train_gpus():
    refused(r"--colocate shares the train GPUs .* --rollout-num-gpus 2 > train GPUs=1", "--colocate",
            "--rollout-num-gpus", "2")


def test_multi_gpu_engines_are_refused():
    refused(r"--rollout-num-gpus-per-engine 2: an engine runs on one device .* use 1", "--rollout-num-gpus", "4",
            "--rollout-num-gpus-per-engine", "2")


def test_train_gpus_per_node_fit_a_node():
    refused(r"--actor-num-gpus-per-node 9 > --num-gpus-per-node 8", "--actor-num-gpus-per-node", "9",
            "--rollout-batch-size", "36", "--colocate")


def test_train_nodes_fit_the_job():
    refused(r"--actor-num-nodes 2 > --num-nodes 1", "--actor-num-nodes", "2", "--num-nodes", "1")


def test_job_nodes_default_to_the_train_nodes():
    assert parse_args(BASE + ["--actor-num-nodes", "2"]).num_nodes == 2


def test_separate_reward_node_is_counted_with_num_nodes():
    # 2 x 8 colocated train + rollout, 4 reward workers x 0.25 GPU on a third node
    argv = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8", "--colocate",
            "--rm-num-workers", "4", "--rm-num-gpus-per-worker", "0.25"]
    refused(r"needs 17 GPUs", *argv)
    assert parse_args(BASE + argv + ["--num-nodes", "3"]).num_nodes == 3


def test_colocated_reward_needs_no_gpus_of_its_own():
    assert plan("--actor-num-gpus-per-node", "7", "--rm-num-workers", "4", "--rm-num-gpus-per-worker", "1",
                "--colocate-reward", "--global-batch-size", "7", "--rollout-batch-size", "7",
                "--rollout-microgroup-size", "1")


def test_train_only_runs_no_rollout_engines():
    assert plan("--actor-num-gpus-per-node", "8", "--loss-type", "sft_loss", "--train-only",
                "--rollout-num-gpus", "4")


def test_cpu_layout_counts_worker_slots():
    refused(r"needs 3 CPU slots .* the job has 2", "--device", "cpu", "--actor-num-gpus-per-node", "2",
            "--num-gpus-per-node", "2")
    assert plan("--device", "cpu", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "2", "--colocate")


# ---- cross-flag rules ----

@pytest.mark.parametrize("extra,match", [
    (["--save-interval", "5"], r"--save-interval 5 needs --save DIR; fix"),
    (["--lora-rank", "8"], r"--lora-rank given without --use-lora; fix"),
    (["--lora-alpha", "8", "--lora-target-modules", "to_q"], r"--lora-alpha, --lora-target-modules given without"),
    (["--num-epoch", "1"], r"exactly one of --num-rollout or --num-epoch is required, both were given"),
    (["--train-only"], r"--train-only runs no rollout engines, which --loss-type policy_loss needs"),
    (["--loss-type", "sft_loss", "--debug-rollout-only"], r"--debug-rollout-only needs rollouts"),
    (["--diffusion-kl-beta", "0.02"], r"--diffusion-kl-beta 0.02 needs a reference policy; fix: add --use-lora"),
    (["--diffusion-kl-beta", "0.02", "--use-ema", "--diffusion-kl-reference", "lora_base"],
     r"--diffusion-kl-reference lora_base needs --use-lora"),
    (["--diffusion-kl-beta", "0.02", "--use-lora", "--diffusion-kl-reference", "ema"],
     r"--diffusion-kl-reference ema needs --use-ema"),
    (["--custom-rm-path", "my_pkg.rm:score"], r"--rm-type brightness and --custom-rm-path my_pkg.rm:score both"),
    (["--custom-loss-function-path", "not a path"], r"--custom-loss-function-path 'not a path' is not a pkg.mod:fn"),
    (["--min-lr", "1e-3"], r"--min-lr 0.001 > --lr 0.0001"),
    (["--min-lr", "1e-5"], r"--min-lr 1e-05 with --lr-decay-style constant: .* fix: --lr-decay-style linear"),
    (["--compute-dtype", "float16", "--rollout-dtype", "float16"],
     r"--compute-dtype float16: training in fp16 needs a gradient scaler.* fix: --compute-dtype bfloat16"),
    (["--param-dtype", "float16", "--compute-dtype", "float16", "--rollout-dtype", "float16"],
     r"--compute-dtype float16: .* fix: --compute-dtype bfloat16"),
    (["--rollout-microgroup-size", "3"], r"--rollout-microgroup-size 3 does not divide --n-samples-per-prompt 8"),
    (["--update-weight-target-module", "transformer_2"], r"sd3 has only transformer"),
    (["--diffusion-model-family", "sd3", "--hf-checkpoint", "/ckpt/mystery"], None),
])
def test_cross_flag_rule_refuses_the_combination(extra, match):
    if match is None:  # an explicit family overrides the name match: accepted
        assert plan(*extra)
        return
    refused(match, *extra)


def test_run_length_is_required():
    refused(r"exactly one of --num-rollout or --num-epoch is required, neither", base=[
        "--hf-checkpoint", "/ckpt/sd3", "--rm-type", "brightness", "--prompt-data", "p"])


def test_reward_is_required_unless_sft():
    base = ["--hf-checkpoint", "/ckpt/sd3", "--num-rollout", "1", "--prompt-data", "p"]
    refused(r"--loss-type policy_loss needs a reward; fix: add --rm-type", base=base)
    assert plan("--loss-type", "sft_loss", base=base)


def test_prompt_data_is_required():
    refused(r"--prompt-data is required", base=BASE[:-2])


def test_family_that_cannot_be_told_from_the_checkpoint_is_refused():
    refused(r"cannot tell the model family from --hf-checkpoint '/ckpt/mystery'; pass --diffusion-model-family",
            "--hf-checkpoint", "/ckpt/mystery")


def test_kl_with_a_reference_is_accepted():
    assert parse_args(BASE + ["--diffusion-kl-beta", "0.02", "--use-ema"]).diffusion_kl_reference == "ema"
    assert parse_args(BASE + ["--diffusion-kl-beta", "0.02", "--use-lora"]).diffusion_kl_reference == "lora_base"


# ---- values derived from other flags ----

def test_lora_defaults_follow_the_rank_and_the_family():
    ns = parse_args(BASE + ["--use-lora"])
    assert (ns.lora_rank, ns.lora_alpha) == (32, 32)
    assert "to_q" in ns.lora_target_modules and "add_q_proj" in ns.lora_target_modules
    assert parse_args(BASE + ["--use-lora", "--lora-rank", "8"]).lora_alpha == 8


def test_lora_values_stay_unset_without_lora():
    ns = parse_args(BASE)
    assert (ns.lora_rank, ns.lora_alpha, ns.lora_target_modules) == (None, None, None)


def test_family_defaults_are_filled_in():
    ns = parse_args(BASE[:1] + ["/ckpt/ltx-video"] + BASE[2:])
    # the shift stays unset: the checkpoint's scheduler config decides (only --diffusion-shift overrides it)
    assert (ns.diffusion_model_family, ns.diffusion_sde_type, ns.diffusion_shift) == ("ltx", "cps", None)
    assert ns.update_weight_target_module == ["transformer"]
    ns = parse_args(WAN)
    assert ns.update_weight_target_module == ["transformer", "transformer_2"] and ns.diffusion_shift is None


def test_explicit_sampling_values_are_kept():
    ns = parse_args(BASE + ["--diffusion-sde-type", "ode", "--diffusion-shift", "2.5"])
    assert (ns.diffusion_sde_type, ns.diffusion_shift) == ("ode", 2.5)


def test_start_rollout_id_is_zero_fresh_and_left_to_the_checkpoint_with_load():
    assert parse_args(BASE).start_rollout_id == 0
    assert parse_args(BASE + ["--load", "ckpt"]).start_rollout_id is None
    assert parse_args(BASE + ["--load", "ckpt", "--start-rollout-id", "3"]).start_rollout_id == 3


def test_run_dir_defaults_to_a_timestamped_dir_under_runs():
    assert re.fullmatch(r"runs/\d{8}-\d{6}", parse_args(BASE).run_dir)
    assert parse_args(BASE + ["--run-dir", "out/x"]).run_dir == "out/x"


def test_microgroup_defaults_to_all_samples_of_a_prompt():
    assert parse_args(BASE).rollout_microgroup_size == 8


def test_validation_of_a_validated_namespace_is_stable():
    from miles.flags.arguments import validate_args

    ns = parse_args(BASE + ["--use-lora", "--global-batch-size", "64"])
    before = vars(ns).copy()
    assert validate_args(ns) == validate_argv(BASE + ["--use-lora", "--global-batch-size", "64"])
    assert vars(ns) == before


def test_compute_batch_plan_leaves_the_namespace_alone():
    from miles.flags.arguments import build_parser, compute_batch_plan

    ns = build_parser().parse_args(BASE + ["--num-steps-per-rollout", "2"])
    before = vars(ns).copy()
    assert compute_batch_plan(ns).global_batch_size == 128
    assert vars(ns) == before


COSMOS = ["--hf-checkpoint", "/ckpt/cosmos3-tiny", "--num-rollout", "2", "--rm-type", "brightness",
          "--prompt-data", "prompts.jsonl", "--diffusion-num-steps", "6", "--diffusion-step-strategy-path",
          "sde_window", "--diffusion-num-sde-steps", "2"]


def test_cosmos_refuses_a_shift_its_karras_sigmas_ignore():
    refused(r"--diffusion-shift 3.0: cosmos3 samples the Karras \(EDM\) sigmas .* fix: drop --diffusion-shift",
            "--diffusion-shift", "3.0", base=COSMOS)


def test_cosmos_refuses_training_its_held_last_step_and_accepts_earlier_windows():
    refused(r"step 5, the last of --diffusion-num-steps 6, may be trained, but cosmos3's schedule holds it at "
            r"sigma_min .* fix: end the trained steps earlier", "--diffusion-sde-window-max-start", "4", base=COSMOS)
    assert plan("--diffusion-sde-window-max-start", "3", base=COSMOS).trainable_steps == (0, 1, 2, 3, 4)
    # a renoising loss trains at a sigma, not on a recorded step: the last one is fine there
    plan("--loss-type", "nft", "--diffusion-sde-window-max-start", "4", base=COSMOS)


def test_ltx2_refuses_sft_whose_videos_do_not_give_its_audio_latents():
    ltx2_sft = ["--hf-checkpoint", "/ckpt/ltx-2.3-tiny", "--num-rollout", "2", "--prompt-data", "prompts.jsonl"]
    refused(r"--loss-type sft_loss: ltx2's sampler state holds audio latents .* fix: train ltx2 with a rollout loss",
            "--loss-type", "sft_loss", base=ltx2_sft)
    assert plan("--rm-type", "brightness", base=ltx2_sft)  # its GRPO is fine
