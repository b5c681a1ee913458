"""The bad inputs of ci/bad_input_sweep.py: one row per input, by entry point.

Each row: a name, the command (argv; `{tmp}` is the row's own scratch folder, `{repo}` the
repository, `{ckpt}` the tiny SD3 checkpoint, `{run}` a finished tiny run copied into {tmp}), the
text the last line must contain (the input it names), an optional setup (a key of SETUPS run in
{tmp} first), and `fast` for rows that stop before any cluster or model (the unit test's subset).
Environment values may name `{tmp}` and `{path}` (the sweep's own PATH).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TINY = "scripts/run_diffusion_grpo_tiny_cpu.py"
SD3_OCR = "scripts/run_diffusion_grpo_sd3_ocr_sglang.py"
MULTINODE = "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py"
# a head of a multi-node launch (--scale full) whose `curl`, first on PATH, fails as it does offline
FAILING_CURL = {"PATH": "{tmp}/bin:{path}", "HF_HOME": "{tmp}/hf", "MASTER_ADDR": "192.0.2.10"}
DRY = {"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0"}


@dataclass(frozen=True)
class BadInput:
    name: str
    argv: tuple[str, ...]
    names: str  # the last line must contain this (the flag or the input it is about)
    env: dict = field(default_factory=dict)
    setup: str | None = None
    fast: bool = False
    timeout: float = 120.0


def _r(name, names, *args, fast=True, env=None, setup=None, script=TINY, timeout=120.0, dry=True):
    argv = ("python3", script, "--output-dir", "{tmp}/out", "--data-dir", "{tmp}/data", *args)
    return BadInput(name, argv, names, {**(DRY if dry else {}), **(env or {})}, setup, fast, timeout)


def _t(name, names, *args, fast=True, setup=None, timeout=60.0, validate=True):
    """train_diffusion.py with a valid minimal base plus `args`; validate=False: a real run, which must
    refuse before it starts Ray (its --run-dir in {tmp})."""
    mode = ("--validate-only",) if validate else ("--run-dir", "{tmp}/run-dir")
    argv = ("python3", "train_diffusion.py", "--hf-checkpoint", "{ckpt}", "--prompt-data", "{tmp}/p.jsonl",
            "--rm-type", "brightness", "--num-rollout", "2", "--rollout-batch-size", "4", *mode, *args)
    return BadInput(name, argv, names, {}, setup or "prompts", fast, timeout)


def _m(module, name, names, *args, fast=True, setup=None, timeout=60.0):
    return BadInput(name, ("python3", "-m", module, *args), names, {}, setup, fast, timeout)


def _s(name, names, *args, fast=True, timeout=60.0):
    return BadInput(name, ("python3", "ci/run_suite.py", "--out", "{tmp}/ci-out", *args), names, {}, None, fast,
                    timeout)


RECIPES = [
    _r("recipe --num-rollout 0", "--num-rollout", "--num-rollout", "0"),
    _r("recipe --num-rollout -3", "--num-rollout", "--num-rollout", "-3"),
    _r("recipe --num-rollout abc", "--num-rollout", "--num-rollout", "abc"),
    _r("recipe --train-ranks 0", "--train-ranks", "--train-ranks", "0"),
    _r("recipe --train-ranks 4", "--train-ranks", "--train-ranks", "4"),
    _r("recipe --seed -5", "--seed", "--seed", "-5"),
    _r("recipe --device tpu", "--device", "--device", "tpu"),
    _r("recipe --no-such-flag", "--no-such-flag", "--no-such-flag"),
    _r("recipe --extra-args unknown flag", "--not-a-flag", "--extra-args", "--not-a-flag 3"),
    _r("recipe --extra-args --micro-batch-size 5 (2-D tile)", "--micro-batch-size", "--extra-args",
       "--micro-batch-size 5"),
    _r("recipe --extra-args --lr -1", "--lr", "--extra-args", "--lr -1"),
    _r("recipe --extra-args --seed -5", "--seed", "--extra-args", "--seed -5"),
    _r("recipe --extra-args --diffusion-model-family wan2_2", "--diffusion-model-family", "--extra-args",
       "--diffusion-model-family wan2_2"),
    _r("recipe --extra-args --lora-target-modules nothing_here", "--lora-target-modules", "--extra-args",
       "--use-lora --lora-target-modules nothing_here"),
    _r("recipe --extra-args --custom-rm-path not a path", "--custom-rm-path", "--extra-args",
       "--custom-rm-path 'not a path'"),
    _r("recipe --extra-args --custom-rm-path missing module", "--custom-rm-path", "--extra-args",
       "--rm-type custom --custom-rm-path no_such_mod:fn"),
    _r("recipe --extra-args --load missing dir", "--load", "--extra-args", "--load {tmp}/nope"),
    _r("recipe read-only --data-dir", "--data-dir", setup="readonly_data", dry=False, timeout=120.0),
    _r("recipe --output-dir is a file", "--output-dir", setup="file_out", dry=False),
    _r("recipe non-UTF-8 prompt file", "bad.jsonl: line 5", "--extra-args", "--prompt-data {tmp}/bad.jsonl", setup="bad_utf8"),
    _r("recipe --num-rollout 1e3", "--num-rollout", "--num-rollout", "1e3"),
    _r("recipe custom loss with one parameter", "userfns:loss_one_param", "--extra-args",
       "--custom-loss-function-path userfns:loss_one_param", setup="custom_fns"),
    _r("recipe custom loss in a module that does not parse", "does not parse", "--extra-args",
       "--custom-loss-function-path userfns_broken:loss", setup="custom_fns_broken"),
    _r("recipe multi-node prepare() download fails", "could not download prompt set", script=MULTINODE,
       setup="failing_curl", env=FAILING_CURL, dry=False),
    # these reach the train ranks / reward workers: a real tiny run of one rollout each (~40 s)
    _r("recipe custom loss returns a float", "(loss, metrics)", "--num-rollout", "1", "--extra-args",
       "--custom-loss-function-path userfns:loss_float", setup="custom_fns", dry=False, fast=False, timeout=240.0),
    _r("recipe custom loss raises", "userfns:loss_raises", "--num-rollout", "1", "--extra-args",
       "--custom-loss-function-path userfns:loss_raises", setup="custom_fns", dry=False, fast=False, timeout=240.0),
    _r("recipe custom reward returns a float", "userfns:rm_float", "--num-rollout", "1", "--extra-args",
       "--rm-type custom --custom-rm-path userfns:rm_float", setup="custom_fns", dry=False, fast=False,
       timeout=240.0),
    _r("recipe custom reward raises", "userfns:rm_raises", "--num-rollout", "1", "--extra-args",
       "--rm-type custom --custom-rm-path userfns:rm_raises", setup="custom_fns", dry=False, fast=False,
       timeout=240.0),
]

TRAIN = [
    _t("train --seed -5", "--seed", "--seed", "-5"),
    _t("train --lr 0", "--lr", "--lr", "0"),
    _t("train --num-rollout 0", "--num-rollout", "--num-rollout", "0"),
    _t("train --rollout-batch-size -1", "--rollout-batch-size", "--rollout-batch-size", "-1"),
    _t("train --n-samples-per-prompt 0", "--n-samples-per-prompt", "--n-samples-per-prompt", "0"),
    _t("train --micro-batch-size 0", "--micro-batch-size", "--micro-batch-size", "0"),
    _t("train --hf-checkpoint missing", "--hf-checkpoint", "--hf-checkpoint", "{tmp}/missing"),
    _t("train --prompt-data missing", "--prompt-data", "--prompt-data", "{tmp}/missing.jsonl", validate=False),
    _t("train --prompt-data non-UTF-8", "bad.jsonl: line 5", "--prompt-data", "{tmp}/bad.jsonl", setup="bad_utf8"),
    _t("train --prompt-data bad JSON", "badjson.jsonl:5", "--prompt-data", "{tmp}/badjson.jsonl", setup="bad_json"),
    _t("train --diffusion-model-family wan2_2 on sd3", "--diffusion-model-family", "--diffusion-model-family",
       "wan2_2"),
    _t("train --lora-target-modules nothing", "--lora-target-modules", "--use-lora", "--lora-target-modules",
       "nothing_here"),
    _t("train --custom-loss-function-path missing", "--custom-loss-function-path", "--custom-loss-function-path",
       "no_such_mod:fn"),
    _t("train --custom-rm-path missing fn", "--custom-rm-path", "--rm-type", "custom", "--custom-rm-path",
       "json:no_such_fn"),
    _t("train --load missing", "--load", "--load", "{tmp}/nope"),
    _t("train --load truncated weights", "model_transformer", "--load", "{tmp}/ckpts", setup="truncated_ckpt"),
    _t("train --load deleted weights", "model_transformer", "--load", "{tmp}/ckpts", setup="deleted_ckpt"),
    _t("train --diffusion-height 63", "--diffusion-height", "--diffusion-height", "63"),
    _t("train unknown flag", "--no-such-flag", "--no-such-flag"),
]

EXPORT = [
    _m("miles.export", "export missing source", "does not exist", "{tmp}/none", "--out", "{tmp}/x"),
    _m("miles.export", "export --out inside run", "--out", "{run}", "--out", "{run}/exp", setup="run"),
    _m("miles.export", "export --out = run --overwrite", "--out", "{run}", "--out", "{run}", "--overwrite",
       setup="run"),
    _m("miles.export", "export --rollout x", "--rollout", "{run}", "--out", "{tmp}/x", "--rollout", "x", setup="run"),
    _m("miles.export", "export --rollout 99", "99", "{run}", "--out", "{tmp}/x", "--rollout", "99", setup="run"),
    _m("miles.export", "export --max-shard-size 0", "--max-shard-size", "{run}", "--out", "{tmp}/x",
       "--max-shard-size", "0", setup="run"),
    _m("miles.export", "export --family wan2_2", "wan2_2", "{run}", "--out", "{tmp}/x", "--family", "wan2_2",
       setup="run"),
    _m("miles.export", "export --ema without EMA", "--ema", "{run}", "--out", "{tmp}/x", "--ema", setup="run"),
    _m("miles.export", "export truncated weights", "model_transformer", "{run}", "--out", "{tmp}/x",
       setup="run_truncated"),
    _m("miles.export", "export --out containing the run", "--out", "{run}", "--out", "{tmp}", setup="run"),
]

REPLAY = [
    _m("miles.replay", "replay missing recipe", "nope.py", "scripts/nope.py"),
    _m("miles.replay", "replay --scale bogus", "--scale", SD3_OCR, "--scale", "bogus"),
    _m("miles.replay", "replay a CPU recipe", "runs on CPU only", TINY),
    _m("miles.replay", "replay --depth bad", "--depth", SD3_OCR, "--depth", "deep"),
]

SAMPLE = [
    _m("miles.rollout.sample", "sample --num-samples -1", "--num-samples", "--hf-checkpoint", "{ckpt}", "--prompt",
       "x", "--out", "{tmp}/g.png", "--num-samples", "-1"),
    _m("miles.rollout.sample", "sample --num-samples 0", "--num-samples", "--hf-checkpoint", "{ckpt}", "--prompt",
       "x", "--out", "{tmp}/g.png", "--num-samples", "0"),
    _m("miles.rollout.sample", "sample --height 63", "--height", "--hf-checkpoint", "{ckpt}", "--prompt", "x",
       "--out", "{tmp}/g.png", "--height", "63"),
    _m("miles.rollout.sample", "sample --num-steps 0", "--num-steps", "--hf-checkpoint", "{ckpt}", "--prompt", "x",
       "--out", "{tmp}/g.png", "--num-steps", "0"),
    _m("miles.rollout.sample", "sample --seed -1", "--seed", "--hf-checkpoint", "{ckpt}", "--prompt", "x",
       "--out", "{tmp}/g.png", "--seed", "-1"),
    _m("miles.rollout.sample", "sample --device cuda (no GPU)", "--device", "--hf-checkpoint", "{ckpt}", "--prompt",
       "x", "--out", "{tmp}/g.png", "--device", "cuda"),
    _m("miles.rollout.sample", "sample missing checkpoint", "--hf-checkpoint", "--hf-checkpoint", "{tmp}/none",
       "--prompt", "x", "--out", "{tmp}/g.png"),
    _m("miles.rollout.sample", "sample --width 100", "--width", "--hf-checkpoint", "{ckpt}", "--prompt", "x",
       "--out", "{tmp}/g.png", "--width", "100"),
]

SUITE = [
    _s("run_suite --gpus 0", "--gpus", "--suite", "nightly-gpu", "--tier", "gpu", "--gpus", "0", "--plan"),
    _s("run_suite --gpus -2 --plan", "--gpus", "--suite", "nightly-gpu", "--tier", "gpu", "--gpus", "-2", "--plan"),
    _s("run_suite --plan --ray-address without --gpus", "--ray-address", "--suite", "nightly-gpu", "--tier",
       "gpu", "--ray-address", "127.0.0.1:2", "--plan"),
    _s("run_suite unreachable --ray-address", "--ray-address", "--suite", "nightly-gpu", "--tier", "gpu",
       "--ray-address", "127.0.0.1:2", fast=False, timeout=90.0),
    _s("run_suite malformed --ray-address", "--ray-address", "--suite", "nightly-gpu", "--tier", "gpu",
       "--ray-address", "not an address", fast=False, timeout=90.0),
    _s("run_suite --suite nope", "--suite", "--suite", "nope", "--plan"),
    _s("run_suite --case nope", "--case", "--case", "nope", "--plan"),
    _s("run_suite --cpu-jobs 0", "--cpu-jobs", "--cpu-jobs", "0", "--plan"),
    _s("run_suite --retry-lost -1", "--retry-lost", "--suite", "nightly-gpu", "--retry-lost", "-1", "--plan"),
    _s("run_suite --suite-json missing", "--suite-json", "--suite-json", "{tmp}/none.json", "--plan"),
]

ALL = RECIPES + TRAIN + EXPORT + REPLAY + SAMPLE + SUITE
