"""miles-diffusion's flags by one rule (miles/flags/flag_vocabulary.py): every flag its current launch
scripts pass is the same here, mapped (the plan shows onto what), left out as having no counterpart
(speed of parts that do not run here), or refused in one line naming what runs here instead."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from miles.flags import flag_vocabulary as V
from miles.flags.arguments import parse_args
from miles.flags.validation import ConfigError

ROOT = Path(__file__).resolve().parents[3]
# The train_diffusion.py flags radixark/miles_diffusion's 28 scripts/run_*.py pass today (names only;
# ci/sweep_launch_scripts.py runs the scripts themselves), and --lora-ipc-weight-sync.
UPSTREAM_FLAGS = """
--actor-num-gpus-per-node --actor-num-nodes --adam-beta2 --adam-eps --advantage-estimator --api-rm-config --clip-grad
--colocate --colocate-reward --custom-convert-samples-to-train-data-path --custom-loss-function-path
--custom-prepare-train-batch-path --custom-rm-args --custom-rm-path --custom-rollout-log-function-path
--debug-skip-optimizer-step --deterministic-mode --diffusion-audio-flow-shift --diffusion-clip-range
--diffusion-debug-mode --diffusion-eval-num-steps --diffusion-flow-shift --diffusion-forward-dtype --diffusion-fps
--diffusion-guidance-scale --diffusion-guidance-scale-2 --diffusion-h3-aspect-ratio --diffusion-h3-duration-seconds
--diffusion-height --diffusion-kl-beta --diffusion-model-family --diffusion-negative-prompt --diffusion-noise-level
--diffusion-nft-beta --diffusion-nft-timestep-fraction --diffusion-num-sde-steps --diffusion-num-steps
--diffusion-output-num-frames --diffusion-recompute-old-log-prob --diffusion-sde-candidate-steps --diffusion-sde-type
--diffusion-sde-window-range --diffusion-step-strategy-path --diffusion-task --diffusion-train-iter-order
--diffusion-true-cfg-scale --diffusion-width --disable-wandb-random-suffix --dp-replicate-size --ema-decay-flat-steps
--ema-decay-init --ema-decay-max --ema-decay-ramp --ema-rollout-policy --eval-interval --eval-prompt-data
--fsdp-attention-backend --fsdp-cpu-offload --fsdp-flow-shift --fsdp-master-dtype --fsdp-reduce-dtype
--global-batch-size --gradient-checkpointing --hf-checkpoint --hps-batch-size --hps-num-workers --hps-reward-colocate
--hps-version --input-key --load --lora-alpha --lora-init-weights --lora-rank --lora-target-modules --loss-type --lr
--lr-warmup-iters --micro-batch-size --micro-batch-size-sample --micro-batch-size-tstep
--miles-router-health-check-failure-threshold --n-samples-per-eval-prompt --n-samples-per-prompt --num-epoch
--num-gpus-per-node --num-rollout --num-steps-per-rollout --ocr-num-workers --pickscore-batch-size
--pickscore-model-path --pickscore-num-frames --pickscore-num-gpus-per-worker --pickscore-num-workers
--pickscore-processor-path --pickscore-reward-colocate --prompt-data --ref-mode --reward-key --rm-type
--rollout-batch-size --rollout-fetch-in-parser --rollout-function-path --rollout-health-check-interval
--rollout-microgroup-size --rollout-num-gpus --rollout-num-gpus-per-engine --rollout-parser-num-workers
--rollout-patch-group --rollout-return-full-trajectory --rollout-shuffle --rollout-weights --save --save-interval
--seed --sequence-parallel-size --sft-encoder-checkpoint --sft-frame-stride --sft-offload-encoder
--sglang-attention-backend --sglang-cpu-offload-components --sglang-dit-precision --sglang-lora-merge-mode
--sglang-model-id --sglang-ring-degree --sglang-server-concurrency --sglang-sp-degree --sglang-text-encoder-cpu-offload
--sglang-tp-size --sglang-ulysses-degree --sglang-vae-cpu-offload --sglang-vae-slicing --skip-eval-before-train
--start-rollout-id --train-backend --train-dp-split-mode --train-only --ulysses-degree --update-weight-buffer-size
--update-weight-target-module --use-ema --use-lora --use-miles-router --use-wandb --wan-controlnet-checkpoint
--wan-controlnet-num-blocks --wandb-dir --wandb-group --wandb-log-image-interval --wandb-log-num-images --wandb-mode
--wandb-project --wandb-team --weight-decay
""".split()
BASE = ("--hf-checkpoint ckpt --diffusion-model-family sd3 --rm-type pickscore --prompt-data p.jsonl --num-rollout 1 "
        "--device cpu --num-gpus-per-node 2 --run-dir runs/fixed").split()


@pytest.mark.parametrize("flag", UPSTREAM_FLAGS)
def test_every_flag_of_miles_diffusions_scripts_has_one_treatment_and_a_refusal_names_what_runs_here(flag):
    treatment = V.treatment(flag)
    if treatment == V.REFUSED:
        assert V.refusal(flag), f"{flag} is refused without naming what runs here"
    elif treatment == V.NO_COUNTERPART:
        assert flag.startswith(("--sglang-", "--use-miles-router", "--miles-router-", "--rollout-health-check-",
                                "--rollout-parser-", "--rollout-fetch-")), f"{flag} changes what is computed"


def test_translate_leaves_out_no_counterpart_flags_lists_the_mapped_and_keeps_the_rest():
    argv = ("--run-dir r --use-miles-router --sglang-server-concurrency 8 --fsdp-master-dtype fp32 "
            "--diffusion-train-iter-order sample_major --update-weight-target-module transformer,transformer_2 "
            "--diffusion-step-strategy-path miles.rollout.step_strategy_hub.sde_window --sglang-tp-size 1 --lr 1e-4").split()
    out = V.translate(argv)
    assert out.argv == [w for w in argv if w not in ("--use-miles-router", "--sglang-server-concurrency", "8",
                                                     "--sglang-tp-size", "1")]
    assert [line.split(":")[0] for line in out.no_counterpart] == [
        "--use-miles-router", "--sglang-server-concurrency 8", "--sglang-tp-size 1"]
    mapped = dict(line.split(" -> ", 1) for line in out.mapped)
    assert "--param-dtype" in mapped["--fsdp-master-dtype fp32"]
    assert mapped["--diffusion-train-iter-order sample_major"] == "sample-major"
    assert mapped["--update-weight-target-module transformer,transformer_2"] == "transformer transformer_2"
    assert mapped["--diffusion-step-strategy-path miles.rollout.step_strategy_hub.sde_window"] == "the built-in sde_window"
    assert "--lr 1e-4" not in mapped


def test_an_engine_parallel_degree_other_than_one_is_refused_in_one_line():
    with pytest.raises(V.FlagRefused, match=r"--sglang-tp-size 2: an engine here runs on one GPU"):
        V.translate(["--sglang-tp-size", "2"])


def test_the_parser_names_the_first_refused_flag_alone_and_never_its_value(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--hps-version", "v2.1", "--fsdp-attention-backend", "sdpa_math"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--hps-version does not run here" in line and "--rm-type" in line
    assert "--fsdp-attention-backend" not in line and "v2.1" not in line


def _parse(words: str):
    return vars(parse_args(BASE + words.split()))


@pytest.mark.parametrize("upstream, ours", [
    ("--diffusion-flow-shift 5.0", "--diffusion-shift 5.0"),
    ("--fsdp-flow-shift 3.0", "--diffusion-shift 3.0"),
    ("--ulysses-degree 1", "--sequence-parallel-size 1"),
    ("--rollout-weights ema --loss-type nft --use-ema", "--ema-rollout-policy ema --loss-type nft --use-ema"),
    ("--pickscore-reward-colocate", "--colocate-reward"),
    ("--sglang-dit-precision bf16 --compute-dtype bfloat16", "--rollout-dtype bfloat16 --compute-dtype bfloat16"),
    ("--lr-warmup-iters 20", "--lr-warmup-steps 20"),
    ("--diffusion-train-iter-order sample_major", "--diffusion-train-iter-order sample-major"),
    ("--update-weight-target-module transformer,transformer", "--update-weight-target-module transformer transformer"),
    ("--diffusion-step-strategy-path miles.rollout.step_strategy_hub.epoch_global_random_choice",
     "--diffusion-step-strategy-path epoch_global_random_choice"),
    ("--diffusion-sde-window-range 3,5 --diffusion-num-sde-steps 2",
     "--diffusion-sde-window-min-start 3 --diffusion-sde-window-max-start 3 --diffusion-num-sde-steps 2"),
])
def test_each_mapped_name_parses_to_what_it_maps_onto(upstream, ours):
    assert _parse(upstream) == _parse(ours)


def test_value_mapped_names_take_the_values_that_run_here():
    sft = "--loss-type sft_loss --train-only --n-samples-per-prompt 1"
    base = [w for w in BASE if w not in ("--rm-type", "pickscore")]
    assert parse_args(base + f"--rollout-function-path miles.rollout.sft_rollout.generate_rollout {sft}".split()).train_only
    ns = parse_args(base + ("--loss-type sft_loss --n-samples-per-prompt 1 --rollout-function-path "
                            "miles.rollout.sft_rollout.generate_rollout --sft-encoder-checkpoint ckpt "
                            "--custom-loss-function-path miles.backends.fsdp_utils.loss_hub.sft.sft_loss_formula").split())
    assert ns.train_only and ns.custom_loss_function_path is None
    qwen = _parse("--diffusion-model-family qwen_image --diffusion-guidance-scale 1.0 --diffusion-true-cfg-scale 4.0")
    assert qwen["diffusion_guidance_scale"] == 4.0
    assert _parse("--diffusion-task t2i")["diffusion_task"] == "t2i"
    assert _parse("--wandb-team my-team")["wandb_entity"] == "my-team"


@pytest.mark.parametrize("words, message", [
    ("--rollout-function-path my.rollout.fn", "a rollout function of its own does not run here"),
    ("--diffusion-task ref2va", "sd3 runs t2i here"),
    ("--diffusion-true-cfg-scale 4.0", "true CFG is Qwen-Image's"),
    ("--diffusion-fps 24", "sd3's forward reads no frame rate"),
    ("--diffusion-model-family ltx2 --diffusion-fps 30", "ltx2 samples at 24 fps"),
    ("--sft-frame-stride 2", "every frame of their strip"),
    ("--n-samples-per-eval-prompt 4", "one deterministic"),
    ("--sglang-lora-merge-mode merged", "unmerged"),
    ("--fsdp-flow-shift visual=12,audio=3", "a shift per stream"),
    ("--sft-encoder-checkpoint other --loss-type sft_loss --train-only --n-samples-per-prompt 1",
     "encoded here by --hf-checkpoint's own"),
    ("--custom-prepare-train-batch-path my.fn", "only miles-diffusion's own"),
    ("--custom-convert-samples-to-train-data-path my.fn", "only miles-diffusion's own"),
    ("--custom-rollout-log-function-path my.fn", "only miles-diffusion's own"),
    ("--custom-prepare-train-batch-path miles.backends.fsdp_utils.loss_hub.sft.prepare_sft_batch", "SFT plumbing"),
    ("--ulysses-degree 4", "sequence parallelism is not implemented"),
    ("--fsdp-reduce-dtype bf16", "the data-parallel backend all-reduces gradients in --param-dtype"),
    ("--fsdp-reduce-dtype fp16 --train-backend fsdp", "fp16 gradients underflow"),
    ("--dp-replicate-size 2 --actor-num-gpus-per-node 2", "needs --train-backend fsdp"),
    ("--dp-replicate-size 2 --actor-num-gpus-per-node 3 --num-gpus-per-node 4 --train-backend fsdp",
     "does not divide the 3 train ranks"),
    ("--diffusion-sde-candidate-steps 1,2", "what epoch_global_random_choice draws from, not sde_window"),
    ("--diffusion-step-strategy-path epoch_global_random_choice --diffusion-sde-candidate-steps 1,12",
     r"step\(s\) 12 outside the 10 steps"),
    ("--diffusion-step-strategy-path epoch_global_random_choice --diffusion-sde-candidate-steps 1,2",
     "> the 2 candidate step"),
    ("--diffusion-sde-window-min-start 2 --diffusion-sde-window-max-start 1", "min start at most the max start"),
    ("--diffusion-recompute-old-log-prob --loss-type nft", "has no PPO ratio"),
    ("--rollout-patch-group wan", "patches the wan2_2 family, this run trains sd3"),
    ("--rollout-patch-group qwen_image21", "a model no family here runs"),
    ("--wandb-log-num-images 8", "without --use-wandb"),
    ("--lora-ipc-weight-sync --colocate", "lacks --use-lora; fix: add --use-lora"),
    ("--lora-ipc-weight-sync --use-lora --lora-rank 4", "lacks --colocate; fix"),
    ("--pickscore-num-frames 8 --rm-type brightness", "only the pickscore reward reads it"),
])
def test_values_that_do_not_run_here_are_refused_in_one_line_naming_the_fix(words, message, capsys):
    with pytest.raises((SystemExit, ConfigError)) as refused:
        _parse(words)
    text = str(refused.value) if refused.type is ConfigError else capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, text), text
    assert "\n" not in text


def test_a_patch_group_of_the_runs_family_and_the_new_capabilities_parse():
    ns = _parse("--diffusion-model-family qwen_image --rollout-patch-group qwen_image --fsdp-reduce-dtype bf16 "
                "--train-backend fsdp --actor-num-gpus-per-node 2 --colocate --dp-replicate-size 2 "
                "--diffusion-recompute-old-log-prob "
                "--diffusion-step-strategy-path epoch_global_random_choice --diffusion-sde-candidate-steps 1,2,3 "
                "--diffusion-num-sde-steps 1")
    assert (ns["fsdp_reduce_dtype"], ns["dp_replicate_size"], ns["diffusion_sde_candidate_steps"]) == (
        "bfloat16", 2, [1, 2, 3])


def test_the_docs_table_lists_every_no_counterpart_and_refused_flag_of_the_vocabulary():
    docs = (ROOT / "docs" / "launch-scripts.md").read_text()
    table = docs[docs.index("## miles-diffusion's flags by one rule"):]
    table = table[:table.index("\n## ", 3)]
    for flag in [*V.NO_COUNTERPART, *V.REFUSED]:
        shown = flag + "*" if flag.endswith("-") else flag
        assert f"`{shown}`" in table, f"{flag} is missing from docs/launch-scripts.md's table"
    parser_aliases = V.alias_meanings()
    for flag in parser_aliases:
        assert f"`{flag}" in table, f"the mapped name {flag} is missing from docs/launch-scripts.md's table"


def test_names_of_what_always_happens_here_parse_unchanged_and_the_plan_says_so():
    """--rollout-return-full-trajectory and --disable-wandb-random-suffix ask for what runs here anyway."""
    words = "--rollout-return-full-trajectory --disable-wandb-random-suffix"
    plain = _parse("")
    given = _parse(words)
    assert given.pop("rollout_return_full_trajectory") is True and given.pop("wandb_random_suffix") is False
    assert given == plain
    mapped = V.translate(words.split()).mapped
    assert mapped == ["--rollout-return-full-trajectory -> engines return every step's latents: here they always do "
                      "(a trajectory holds all N+1)",
                      "--disable-wandb-random-suffix -> wandb run names without a random suffix: here they never "
                      "have one (--wandb-run-name as given)"]


def test_lora_ipc_weight_sync_is_ours_and_holds_a_lora_run_to_the_colocated_ipc_push():
    from miles.ray.weight_sync_group import push_transport

    assert V.treatment("--lora-ipc-weight-sync") == V.SAME
    ns = _parse("--lora-ipc-weight-sync --use-lora --lora-rank 4 --colocate")
    assert ns["lora_ipc_weight_sync"] is True
    assert push_transport(argparse.Namespace(**ns)) == "ipc"
