"""miles-diffusion's train_diffusion.py names: each parses to exactly what our flag it maps to parses
to (so it has that flag's effect, tested under that flag), and the flags of parts this project does
not ship are refused with one line naming what runs here."""

import pytest

from miles.flags.arguments import parse_args
from miles.flags.validation import ConfigError

BASE = ["--hf-checkpoint", "ckpt", "--diffusion-model-family", "sd3", "--rm-type", "brightness",
        "--prompt-data", "p.jsonl", "--num-rollout", "1", "--device", "cpu", "--num-gpus-per-node", "2",
        # fixed: unset, each parse stamps the current second into it, and two parses a second apart differ
        "--run-dir", "runs/fixed"]

# (miles-diffusion's words, our words): both must parse to the same namespace
SAME_AS = [
    (["--diffusion-forward-dtype", "bf16"], ["--compute-dtype", "bfloat16", "--rollout-dtype", "bfloat16"]),
    (["--fsdp-master-dtype", "bf16", "--diffusion-forward-dtype", "bf16"],
     ["--param-dtype", "bfloat16", "--compute-dtype", "bfloat16", "--rollout-dtype", "bfloat16"]),
    (["--pickscore-num-workers", "3"], ["--rm-num-workers", "3"]),
    (["--ocr-num-workers", "2"], ["--rm-num-workers", "2"]),
    (["--pickscore-num-gpus-per-worker", "0"], ["--rm-num-gpus-per-worker", "0"]),
    (["--diffusion-reward", "color_match"], ["--rm-type", "color_match"]),
    (["--diffusion-microgroup-size", "2"], ["--rollout-microgroup-size", "2"]),
    (["--diffusion-negative-prompt", "blurry"], ["--negative-prompt", "blurry"]),
    (["--diffusion-device", "cuda", "--diffusion-device", "cpu"], ["--device", "cuda", "--device", "cpu"]),
    (["--diffusion-sde-window-size", "2", "--diffusion-sde-window-range", "0,3"],
     ["--diffusion-num-sde-steps", "2", "--diffusion-sde-window-max-start", "1"]),
    (["--diffusion-sde-window-size", "2", "--diffusion-sde-window-size", "0"], ["--diffusion-num-sde-steps", "2", "--diffusion-num-sde-steps", "4", "--diffusion-num-sde-steps", "10"]),
    (["--colocate", "--offload"], ["--colocate", "--offload-train", "--offload-rollout"]),
]


def _ns(words):
    return vars(parse_args(BASE + words))


@pytest.mark.parametrize("public, ours", SAME_AS, ids=[p[0] for p, _ in SAME_AS])
def test_each_public_name_parses_to_what_the_flag_it_names_parses_to(public, ours):
    assert _ns(public) == _ns(ours)


def test_a_later_spelling_of_the_same_flag_wins_whichever_name_it_uses():
    assert _ns(["--pickscore-num-workers", "3", "--rm-num-workers", "2"])["rm_num_workers"] == 2
    assert _ns(["--rm-num-workers", "2", "--pickscore-num-workers", "3"])["rm_num_workers"] == 3


def test_named_eval_prompt_data_keeps_the_path_and_the_name():
    named = _ns(["--eval-prompt-data", "pickscore", "e.jsonl", "--eval-interval", "2"])
    plain = _ns(["--eval-prompt-data", "e.jsonl", "--eval-interval", "2"])
    assert (named["eval_prompt_data"], named["eval_prompt_name"]) == ("e.jsonl", "pickscore")
    assert (plain["eval_prompt_data"], plain["eval_prompt_name"]) == ("e.jsonl", None)
    with pytest.raises(ConfigError, match="one eval set"):
        _ns(["--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl"])


def test_miles_diffusion_eval_and_pickscore_words_parse_as_they_are_written_there():
    """The lines of miles-diffusion's PickScore recipes, word for word (their effects: flag_effects.py)."""
    ns = _ns(["--diffusion-eval-num-steps", "28", "--eval-interval", "20", "--skip-eval-before-train",
              "--pickscore-batch-size", "8", "--pickscore-processor-path", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"])
    assert (ns["diffusion_eval_num_steps"], ns["skip_eval_before_train"], ns["pickscore_batch_size"]) == (28, True, 8)
    assert ns["pickscore_processor_path"] == "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    unset = _ns([])
    assert (unset["diffusion_eval_num_steps"], unset["skip_eval_before_train"], unset["pickscore_processor_path"]) == (
        None, False, None)


def test_debug_train_only_is_train_only():
    words = ["--loss-type", "sft_loss"]
    base = [w for w in BASE if w not in ("--rm-type", "brightness")]
    assert vars(parse_args(base + words + ["--debug-train-only"])) == vars(parse_args(base + words + ["--train-only"]))


@pytest.mark.parametrize("flag, names", [
    ("--sglang-mem-fraction-static", "miles.rollout.engine"),
    ("--use-miles-router", "rollout_manager"),
    ("--rollout-health-check-interval", "--remote-timeout"),
    ("--wandb-key", "WANDB_API_KEY"),
    ("--megatron-to-hf-mode", "--train-backend"),
])
def test_flags_of_parts_not_shipped_are_refused_naming_what_runs_here(flag, names, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + [flag, "s3cr3t-value"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and names in err and flag in err
    assert "s3cr3t-value" not in err  # a refused flag's value is never echoed (it may be a key)


def test_public_dtype_words_outside_fp16_bf16_fp32_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--diffusion-forward-dtype", "fp8"])
    assert "--diffusion-forward-dtype" in capsys.readouterr().err
