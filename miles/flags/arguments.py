"""Every train_diffusion.py flag, the YAML override, and the parse -> validate -> plan entry points.

Nothing here imports torch or Ray: `--help` and `--validate-only` must answer in a fraction of a
second, and the harness validates recipe argv in process. For a flag given twice the later
occurrence wins; boolean flags have a `--no-` form so `--extra-args` can switch a recipe's off.
"""

from __future__ import annotations

import argparse
import logging
import re
from typing import Any, Sequence

from miles.flags.batching import ITER_ORDERS, SPLIT_MODES, BatchPlan
from miles.flags.capability_flags import add_capability_flags
from miles.diffusion_facts.families import FAMILY_NAMES
from miles.flags.value_types import (
    any_float, any_int, fraction, non_negative_float, non_negative_int, positive_float, positive_int, unit_interval,
)
from miles.flags.public_flags import add_public_flags, normalize_public_values, unrecognized_message
from miles.flags.validation import ConfigError, compute_batch_plan, validate_args

__all__ = [
    "BatchPlan", "ConfigError", "build_parser", "compute_batch_plan", "parse_and_plan", "parse_args",
    "validate_args", "validate_argv",
]

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
TRAIN_BACKENDS = ("dp", "fsdp")
LOSS_TYPES = ("policy_loss", "nft", "sft_loss")
SDE_TYPES = ("sde", "ode", "cps")
WEIGHT_SYNC_MODES = ("bucketed", "object-store")
# Flags that steer parsing itself; a config file setting them would be read too late to matter.
NOT_FROM_CONFIG_FILE = ("custom_config_path", "validate_only", "help")


# ---- value types ----

def _dashed(value: str) -> str:
    """`sample_major` (miles-diffusion's spelling) is `sample-major`."""
    return str(value).replace("_", "-")


# ---- the parser ----

class SuggestingArgumentParser(argparse.ArgumentParser):
    """argparse that names the closest known flag when it meets an unknown one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # `--lr -1e-4` is a value (refused by the flag's own sign rule), not an unknown option
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.IGNORECASE)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized_message(extras, self.known_flags()))
        return namespace

    def known_flags(self) -> list[str]:
        return [flag for action in self._actions for flag in action.option_strings]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only when there is one: "unset" is spelled out in the help where it matters."""

    def _get_help_string(self, action):
        if action.default is None or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _short_numeric_metavars(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.metavar is None and action.type in (positive_int, non_negative_int, any_int):
            action.metavar = "N"
        elif action.metavar is None and action.type in (any_float, positive_float, non_negative_float,
                                                         unit_interval):
            action.metavar = "X"


def build_parser() -> SuggestingArgumentParser:
    parser = SuggestingArgumentParser(
        prog="train_diffusion.py",
        usage="%(prog)s --hf-checkpoint DIR [flags]   (every flag: --help)",
        description="RL post-training of diffusion models (Flow-GRPO, DiffusionNFT, SFT) on Ray. "
        "Validation runs on every parse; --validate-only prints the batch plan and exits.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a recipe's mistyped flag must fail, not silently match a prefix
    )
    for add_group in (_cluster, _batch, _sampling, _model, _algorithm, _optimizer, _lora, _reward,
                      _data, _eval, _checkpoint, _debug, _determinism, _logging, _config):
        add_group(parser)
    add_capability_flags(parser)  # miles-diffusion's flags of capabilities, same names
    add_public_flags(parser)  # miles-diffusion's names for the same flags
    _short_numeric_metavars(parser)
    return parser


def _switch(group, flag: str, help: str) -> None:
    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=False, help=help)


def _cluster(parser) -> None:
    g = parser.add_argument_group(
        "cluster", "where training, rollout and reward run. Rule: train GPUs (actor nodes x GPUs per node) "
        "+ rollout GPUs unless --colocate + reward GPUs (workers x GPUs per worker, rounded up; 0 with "
        "--colocate-reward) <= num_nodes x num_gpus_per_node")
    g.add_argument("--actor-num-nodes", type=positive_int, default=1, help="nodes of train ranks")
    g.add_argument("--actor-num-gpus-per-node", type=positive_int, default=1,
                   help="train ranks per node (GPUs; CPU train ranks with --device cpu)")
    g.add_argument("--rollout-num-gpus", type=positive_int, default=None,
                   help="GPUs of all rollout engines; unset: the train GPUs with --colocate, else 1")
    g.add_argument("--rollout-num-gpus-per-engine", type=positive_int, default=1,
                   help="GPUs per rollout engine; must divide --rollout-num-gpus")
    g.add_argument("--num-gpus-per-node", type=positive_int, default=8,
                   help="GPUs (CPU worker slots with --device cpu) the job has per node")
    g.add_argument("--num-nodes", type=positive_int, default=None,
                   help="nodes the job has; unset: --actor-num-nodes. The job's GPUs are "
                   "num_nodes x num_gpus_per_node")
    _switch(g, "--colocate", "rollout engines share the train GPUs")
    g.add_argument("--sequence-parallel-size", type=positive_int, default=1,
                   help="ranks that split one sequence; dp_size = train ranks / this")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where models run")
    g.add_argument("--train-backend", choices=TRAIN_BACKENDS, default="dp",
                   help="dp: every train rank holds the whole model and all-reduces gradients; fsdp: FSDP2 "
                   "shards each trained transformer (one unit per block) across the train ranks, params, grads "
                   "and AdamW state / ranks")
    _switch(g, "--offload-train", "with --colocate: between train steps the train ranks keep weights and "
            "optimizer state in host memory, so the engines sampling on their GPUs have the memory")
    _switch(g, "--offload-rollout", "with --colocate: engines keep their weights in host memory from the end of "
            "each generate until the next weight load or generate, so training has the memory")
    g.add_argument("--gpu-memory-gb", type=positive_float, default=None,
                   help="memory of each GPU in GiB (H100: 80, H200: 141); the memory plan refuses a layout whose "
                   "per-GPU estimate exceeds it minus 10%% headroom; unset: GPU 0's by NVML, else 80")
    g.add_argument("--host-memory-gb", type=positive_float, default=None, help="host memory of each node in GiB; "
                   "the host plan refuses a layout whose per-node estimate exceeds it minus 10%% headroom; unset: 1024")


def _batch(parser) -> None:
    g = parser.add_argument_group(
        "batch", "samples per rollout = rollout_batch_size x n_samples_per_prompt = "
        "global_batch_size x num_steps_per_rollout; train pairs = samples x trained steps")
    g.add_argument("--rollout-batch-size", type=positive_int, default=32, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=positive_int, default=8, help="samples per prompt")
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="samples per optimizer step; unset: derived from --num-steps-per-rollout")
    g.add_argument("--num-steps-per-rollout", type=positive_int, default=None,
                   help="optimizer steps per rollout; unset: derived from --global-batch-size, or 1")
    g.add_argument("--micro-batch-size", type=positive_int, default=None,
                   help="flat micro-batch: consecutive train pairs per forward and backward pass (None: the "
                        "rollout tile, one microgroup x 1 timestep; 1 without rollouts); with rollouts every "
                        "forward must be one microgroup at one timestep, as the engines ran it")
    g.add_argument("--micro-batch-size-sample", type=positive_int, default=None,
                   help="2D tile: samples per backward pass (with --micro-batch-size-tstep; overrides the flat "
                        "size)")
    g.add_argument("--micro-batch-size-tstep", type=positive_int, default=None,
                   help="2D tile: timesteps per backward pass (with --micro-batch-size-sample)")
    g.add_argument("--diffusion-train-iter-order", choices=ITER_ORDERS, default="sample-major", type=_dashed,
                   help="order the 2D tiles of an optimizer step are visited in")
    g.add_argument("--train-dp-split-mode", choices=SPLIT_MODES, default="contiguous",
                   help="deal the sample-major pair list to DP ranks in blocks or round-robin")
    g.add_argument("--num-rollout", type=positive_int, default=None,
                   help="rollouts to run (this or --num-epoch)")
    g.add_argument("--num-epoch", type=positive_int, default=None,
                   help="epochs over the prompt data (this or --num-rollout)")


def _sampling(parser) -> None:
    g = parser.add_argument_group("sampling", "the rollout sampler and which steps are trained")
    g.add_argument("--diffusion-num-steps", type=positive_int, default=10, help="denoising steps per sample")
    g.add_argument("--diffusion-num-sde-steps", type=positive_int, default=None,
                   help="steps per sample that are SDE steps and get trained; unset: "
                        "int(--diffusion-num-steps x --diffusion-timestep-fraction)")
    g.add_argument("--diffusion-timestep-fraction", "--diffusion-nft-timestep-fraction", type=fraction,
                   default=0.99, help="unset --diffusion-num-sde-steps trains the first int(steps x this) steps "
                   "(flow_grpo's and DiffusionNFT's timestep_fraction); 1.0 also trains the terminal step")
    g.add_argument("--diffusion-step-strategy-path", default="sde_window",
                   help="which steps are trained: sde_window, epoch_global_random_choice, or a "
                   "function pkg.mod:fn / pkg.mod.fn")
    g.add_argument("--diffusion-sde-window-max-start", type=non_negative_int, default=0,
                   help="sde_window: the window starts at a step in 0..this")
    g.add_argument("--diffusion-noise-level", type=non_negative_float, default=0.7, help="SDE noise level a")
    g.add_argument("--diffusion-guidance-scale", type=non_negative_float, default=4.0,
                   help="classifier-free guidance scale (Wan2.2: the high-noise expert's)")
    g.add_argument("--diffusion-guidance-scale-2", type=non_negative_float, default=None,
                   help="Wan2.2 only: the low-noise expert's guidance scale (required when it runs)")
    g.add_argument("--diffusion-height", type=positive_int, default=512, help="image height, pixels")
    g.add_argument("--diffusion-width", type=positive_int, default=512, help="image width, pixels")
    g.add_argument("--diffusion-output-num-frames", type=positive_int, default=1, help="video frames")
    g.add_argument("--diffusion-sde-type", choices=SDE_TYPES, default=None,
                   help="the step's SDE; unset: the family's default")
    g.add_argument("--diffusion-shift", type=positive_float, default=None,
                   help="sigma schedule shift; overrides the checkpoint's scheduler_config.json (its shift "
                        "and dynamic shifting) with a warning; unset: the checkpoint's scheduler config decides")
    g.add_argument("--diffusion-max-sequence-length", type=positive_int, default=None,
                   help="prompt tokens, the pipeline's max_sequence_length; unset: the family pipeline's default")
    g.add_argument("--negative-prompt", default="", help="negative prompt for guidance")
    g.add_argument("--rollout-microgroup-size", type=positive_int, default=None,
                   help="samples of a prompt an engine denoises as one batch (one model forward per step; "
                        "each train forward is one such microgroup at one timestep); unset: all of them")
    g.add_argument("--rollout-seed", type=non_negative_int, default=42, help="seed of rollout noise and prompt order")
    _switch(g, "--rollout-shuffle", "shuffle the prompt order each epoch")


def _model(parser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--hf-checkpoint", required=True,
                   help="diffusers-layout checkpoint directory (its name can select the family)")
    g.add_argument("--diffusion-model-family", choices=FAMILY_NAMES, default=None,
                   help="model family; unset: matched from the checkpoint's name")
    g.add_argument("--update-weight-target-module", nargs="+", default=None,
                   help="transformer components trained and pushed to engines; unset: all")
    g.add_argument("--weight-sync", choices=WEIGHT_SYNC_MODES, default="bucketed",
                   help="how trained weights reach the engines: buckets over a torch.distributed group, or "
                        "whole state dicts through Ray's object store")
    g.add_argument("--update-weight-buffer-size", type=any_int, default=None,
                   help="bytes per weight-sync bucket (--weight-sync bucketed); unset: 512 MiB")
    _switch(g, "--lora-ipc-weight-sync", "push a LoRA run's adapters only, to its colocated engines through IPC "
            "handles (what --use-lora with --colocate does here; refused without them)")
    g.add_argument("--param-dtype", choices=DTYPES, default="float32", help="dtype of trained weights")
    g.add_argument("--compute-dtype", choices=DTYPES, default="float32",
                   help="dtype of train forwards; float16 is refused (no gradient scaler): use bfloat16")
    g.add_argument("--rollout-dtype", choices=DTYPES, default="float32", help="dtype of rollout forwards")
    _switch(g, "--gradient-checkpointing", "recompute activations in the backward pass")


def _algorithm(parser) -> None:
    g = parser.add_argument_group("algorithm")
    g.add_argument("--loss-type", choices=LOSS_TYPES, default="policy_loss", help="training objective")
    g.add_argument("--custom-loss-function-path", default=None,
                   help="pkg.mod:fn, a function `def loss(args, inputs) -> (loss, metrics)`: inputs is "
                        "miles.backends.loss.PolicyLossInputs, loss a scalar tensor, metrics a dict of tensors "
                        "(the preflight checks it takes 2 positional arguments)")
    g.add_argument("--advantage-estimator", choices=("grpo",), default="grpo", help="advantage estimator")
    g.add_argument("--diffusion-clip-range", type=positive_float, default=1e-4, help="PPO ratio clip eps")
    g.add_argument("--diffusion-adv-clip-max", type=positive_float, default=5.0, help="advantage clamp")
    g.add_argument("--diffusion-kl-beta", type=non_negative_float, default=None,
                   help="KL penalty weight; > 0 needs a reference (--use-lora or --use-ema); unset: 0, "
                        "or DiffusionNFT's 1e-4 under --loss-type nft --use-lora")
    g.add_argument("--diffusion-kl-reference", "--ref-mode", choices=("auto", "lora_base", "ema"), default="auto",
                   help="KL reference; auto: the LoRA base with --use-lora, else the EMA")
    _switch(g, "--globalize-reward-mean", "advantage mean over the whole batch, not per prompt")
    _switch(g, "--globalize-reward-std", "advantage std over the whole batch, not per prompt")
    g.add_argument("--nft-beta", "--diffusion-nft-beta", type=positive_float, default=1.0, help="DiffusionNFT beta")
    g.add_argument("--diffusion-nft-adaptive-weight", action=argparse.BooleanOptionalAction, default=True,
                   help="nft: divide each x0 error by its detached per-sample mean |error| (DiffusionNFT's)")
    _switch(g, "--use-ema", "keep an EMA of the trained weights")
    g.add_argument("--ema-decay", type=unit_interval, default=0.995, help="EMA decay")
    g.add_argument("--ema-rollout-policy", choices=("live", "ema"), default=None,
                   help="weights the engines sample with: the trained ones, or an old policy that follows "
                        "them by a ramped EMA once per rollout (nft only); unset: ema under nft, else live")
    g.add_argument("--ema-decay-init", type=unit_interval, default=0.0,
                   help="old policy's decay during the first --ema-decay-flat-steps optimizer steps")
    g.add_argument("--ema-decay-ramp", type=non_negative_float, default=0.001,
                   help="old policy's decay grows by this per optimizer step after the flat steps")
    g.add_argument("--ema-decay-max", type=unit_interval, default=0.5, help="old policy's decay ceiling")
    g.add_argument("--ema-decay-flat-steps", type=non_negative_int, default=0,
                   help="optimizer steps the old policy's decay stays at --ema-decay-init")
    _switch(g, "--train-uncond-branch", "let gradient flow through the unconditional CFG branch in training "
            "(flow_grpo's SD3 trainer detaches it)")
    _switch(g, "--keep-zero-advantage-samples", "policy_loss: keep samples whose advantage is exactly 0 (flat "
            "groups) in the loss; flow_grpo drops them")


def _optimizer(parser) -> None:
    g = parser.add_argument_group("optimizer", "AdamW")
    g.add_argument("--lr", type=positive_float, default=1e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=non_negative_float, default=0.0,
                   help="learning rate the linear/cosine decay ends at (refused with the constant style)")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant",
                   help="learning rate schedule after warmup, over every optimizer step of the run "
                        "(--num-rollout, or --num-epoch passes over the prompt data)")
    g.add_argument("--lr-warmup-steps", type=non_negative_int, default=0, help="linear warmup, optimizer steps")
    g.add_argument("--adam-beta1", type=unit_interval, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=unit_interval, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=positive_float, default=1e-8, help="Adam epsilon")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.0, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=non_negative_float, default=1.0, help="max grad norm; 0 disables")
    g.add_argument("--seed", type=non_negative_int, default=1234, help="seed of the trainer")


def _lora(parser) -> None:
    g = parser.add_argument_group("lora", "PEFT LoRA adapters; the --lora-* flags need --use-lora")
    _switch(g, "--use-lora", "train LoRA adapters instead of the full weights")
    g.add_argument("--lora-rank", type=positive_int, default=None, help="LoRA rank; unset: 32")
    g.add_argument("--lora-alpha", type=positive_int, default=None, help="LoRA alpha; unset: the rank")
    g.add_argument("--lora-init-weights", choices=("gaussian", "kaiming-uniform"), default="gaussian",
                   help="lora_A's init (lora_B starts at zero either way); gaussian is flow_grpo's")
    g.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="module names to adapt; unset: the family's")


def _reward(parser) -> None:
    from miles.flags.reward_names import BUILTIN_REWARDS, CUSTOM_CONTRACT, rm_type

    g = parser.add_argument_group("reward", "--rm-type or --custom-rm-path (not with sft_loss)")
    g.add_argument("--rm-type", type=rm_type, default=None, metavar="NAME",
                   help=f"the reward: one of {', '.join(BUILTIN_REWARDS)}, or 'custom' (with --custom-rm-path)")
    g.add_argument("--custom-rm-path", default=None, help=f"reward function pkg.mod:fn: {CUSTOM_CONTRACT}")
    g.add_argument("--reward-key", default=None, help="key of the reward when the model returns a dict")
    g.add_argument("--rm-num-workers", type=positive_int, default=1, help="reward workers")
    g.add_argument("--rm-num-gpus-per-worker", type=non_negative_float, default=0.0,
                   help="GPU fraction per reward worker")
    _switch(g, "--colocate-reward", "reward workers share the train/rollout GPUs")
    g.add_argument("--pickscore-model-path", default=None, help="PickScore checkpoint directory")
    g.add_argument("--pickscore-processor-path", default=None,
                   help="folder of PickScore's tokenizer and image processor; unset: --pickscore-model-path")
    g.add_argument("--pickscore-batch-size", type=positive_int, default=32,
                   help="image-prompt pairs per PickScore forward (scores do not depend on it)")
    g.add_argument("--reward-timeout", type=positive_float, default=300.0, help="seconds per reward batch")


def _data(parser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--prompt-data", default=None, help="JSONL file of prompts (SFT: of items)")
    g.add_argument("--input-key", default="prompt", help="JSONL key of the prompt")
    g.add_argument("--metadata-key", default="metadata", help="JSONL key of per-prompt metadata")


def _eval(parser) -> None:
    g = parser.add_argument_group("eval")
    g.add_argument("--eval-interval", type=positive_int, default=None, help="evaluate every N rollouts")
    g.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="[NAME] PATH",
                   help="JSONL prompts for eval, held out from --prompt-data; NAME also logs eval/<NAME>/...")
    g.add_argument("--eval-num-prompts", type=positive_int, default=None, help="eval prompts; unset: all")
    g.add_argument("--diffusion-eval-num-steps", type=positive_int, default=None,
                   help="denoising steps of each eval sample; unset: --diffusion-num-steps")
    _switch(g, "--skip-eval-before-train",
            "with --eval-interval, no eval of the initial weights before rollout 0 (a fresh run evaluates them)")


def _checkpoint(parser) -> None:
    g = parser.add_argument_group("checkpoint")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--save-interval", type=positive_int, default=None, help="save every N rollouts (needs --save)")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--start-rollout-id", type=non_negative_int, default=None,
                   help="first rollout id; unset: from --load, else 0")
    _switch(g, "--load-anyway", "load a --load checkpoint trained with other training flags (each difference is "
            "printed and recorded in run.json); without it such a load is refused")
    g.add_argument("--keep-last", type=positive_int, default=None,
                   help="keep only the newest N committed checkpoints under --save; unset: keep all")
    g.add_argument("--keep-every", type=positive_int, default=None,
                   help="with --keep-last: also keep each checkpoint whose rollout count is a multiple of K")


def _debug(parser) -> None:
    g = parser.add_argument_group("debug")
    _switch(g, "--diffusion-debug-mode", "engines return every step's model output; log train/rollout parity")
    g.add_argument("--diffusion-debug-probe-micro-batches", type=non_negative_int, default=None,
                   help="with --diffusion-debug-mode: the parity probe checks the first N micro-batches of each "
                        "rollout (0: every one); the first optimizer step's come free with its training forward, "
                        "a later one costs a no-grad forward on the weights before the step. Unset: every one "
                        "with --device cpu (the CPU tier), 1 on GPUs (under 2 %% of a train step)")
    _switch(g, "--stop-on-parity-drift", "with --diffusion-debug-mode: end the run at the first rollout whose parity "
            "probe reads non-zero, naming the weight tensors whose dtype or value differed between the train "
            "forward and the engines (each rollout digests both sides' weights first)")
    _switch(g, "--debug-skip-optimizer-step", "compute losses and grads, never step")
    _switch(g, "--debug-rollout-only", "generate and score, never train")
    _switch(g, "--train-only", "train without rollout engines (sft_loss)")
    g.add_argument("--debug-skip-weight-update-at", type=non_negative_int, default=None,
                   help="skip the weight push after this rollout id (proves the parity probe can fail)")
    g.add_argument("--debug-fault", type=_fault_spec, default=None, metavar="KIND@ROLLOUT",
                   help="inject one fault at a rollout, once per run dir (the fault suite, docs/faults.md); "
                        "KIND: " + ", ".join(_fault_kinds()))
    g.add_argument("--remote-timeout-s", type=positive_float, default=1800.0,
                   help="deadline of a remote call the driver waits on before that kind of call was measured "
                        "(actor start, the first rollout)")
    g.add_argument("--remote-timeout-factor", type=positive_float, default=10.0,
                   help="afterwards a call may take this many times the slowest call of its kind so far ...")
    g.add_argument("--remote-timeout-min-s", type=positive_float, default=120.0,
                   help="... but never less than this; a call past its deadline ends the run naming the actor")
    g.add_argument("--placement-timeout-s", type=positive_float, default=600.0,
                   help="how long the driver waits for the cluster to place the run's actors when the resources "
                        "exist but are busy (or nodes are still joining), with a progress line every 30 s; a layout "
                        "the cluster can never hold is refused at once (docs/faults.md)")


def _fault_kinds() -> list[str]:
    from miles.flags.debug_faults import FAULT_KINDS

    return list(FAULT_KINDS)


def _fault_spec(value: str) -> str:
    from miles.flags.debug_faults import parse_fault

    try:
        parse_fault(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).split(": ", 1)[1]) from None
    return value


def _determinism(parser) -> None:
    g = parser.add_argument_group("determinism")
    _switch(g, "--deterministic-mode", "seeded, deterministic kernels: identical runs, identical metrics")


def _logging(parser) -> None:
    g = parser.add_argument_group("logging", "the wandb key is read from WANDB_API_KEY, never a flag")
    g.add_argument("--run-dir", default=None,
                   help="where metrics.jsonl, run.json, plots and grids go; unset: runs/<timestamp>")
    _switch(g, "--use-wandb", "mirror metrics to wandb")
    g.add_argument("--wandb-project", default=None, help="wandb project")
    g.add_argument("--wandb-group", default=None, help="wandb group")
    g.add_argument("--wandb-run-name", default=None, help="wandb run name")
    g.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default=None,
                   help="wandb mode; unset: $WANDB_MODE, else online")
    _switch(g, "--wandb-required", "stop before training if wandb cannot start (default: warn and go on)")
    g.add_argument("--wandb-dir", default=None, help="wandb directory")


def _config(parser) -> None:
    g = parser.add_argument_group("config")
    g.add_argument("--custom-config-path", default=None,
                   help="YAML mapping of flag -> value (dest or flag form); overrides the command line, "
                   "warning per key; an unknown key is an error")
    _switch(g, "--validate-only", "parse and validate, check the files that exist (as a recipe's dry run "
            "does), print the batch plan, exit (no torch, no Ray)")


# ---- the YAML override ----

def apply_config_file(parser: argparse.ArgumentParser, namespace: argparse.Namespace, path: str) -> None:
    """Override parsed values key by key from a YAML mapping, warning for each key."""
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    for key, value in _read_yaml_mapping(path).items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions or dest in NOT_FROM_CONFIG_FILE:
            raise ConfigError(_unknown_key_message(path, key, actions))
        new_value = _coerce(actions[dest], value, path, key)
        logger.warning("--custom-config-path %s sets %s=%r (was %r)",
                       path, dest, new_value, getattr(namespace, dest))
        setattr(namespace, dest, new_value)


def _read_yaml_mapping(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle)
    except OSError as error:
        raise ConfigError(f"--custom-config-path {path}: cannot read it ({error.strerror}); fix the path") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"--custom-config-path {path}: not valid YAML ({' '.join(str(error).split())})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--custom-config-path {path}: expected a mapping of flag -> value, "
                          f"got {type(loaded).__name__}")
    return loaded


def _unknown_key_message(path: str, key: Any, actions: dict) -> str:
    import difflib

    settable = [dest for dest in actions if dest not in NOT_FROM_CONFIG_FILE]
    close = difflib.get_close_matches(str(key).lstrip("-").replace("-", "_"), settable, n=1)
    hint = f"; did you mean {close[0]}?" if close else "; keys are flag names in dest or flag form"
    return f"--custom-config-path {path}: unknown key {key!r}{hint}"


def _coerce(action: argparse.Action, value: Any, path: str, key: Any) -> Any:
    try:
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
            return value
        if value is None:
            return None
        if action.nargs in ("+", "*"):
            items = value if isinstance(value, list) else [value]
            return [_coerce_one(action, item) for item in items]
        return _coerce_one(action, value)
    except argparse.ArgumentTypeError as error:
        raise ConfigError(f"--custom-config-path {path}: key {key!r}: {error}") from None


def _coerce_one(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise argparse.ArgumentTypeError(f"expected a single value, got {value!r}")
    converted = action.type(value) if action.type else str(value)
    if action.choices is not None and converted not in action.choices:
        raise argparse.ArgumentTypeError(
            f"{converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


# ---- entry points ----

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, apply --custom-config-path, validate; derived values are filled in. Raises ConfigError.

    argparse errors (unknown flag, bad value) exit with status 2 as argparse does.
    """
    return parse_and_plan(argv)[0]


def parse_and_plan(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, BatchPlan]:
    parser = build_parser()
    namespace = parser.parse_args(list(argv) if argv is not None else None)
    if namespace.custom_config_path:
        apply_config_file(parser, namespace, namespace.custom_config_path)
    normalize_public_values(namespace)
    return namespace, validate_args(namespace)


def validate_argv(argv: Sequence[str]) -> BatchPlan:
    """The harness's in-process check of a recipe's argv: the plan, or ConfigError."""
    return parse_and_plan(argv)[1]
