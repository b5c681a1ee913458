"""miles-diffusion's train_diffusion.py flag names, accepted with the same meaning, and the flags of
parts this project does not ship (sglang servers, the router, Megatron), refused with one line
naming what runs here instead. docs/launch-scripts.md lists the mapping.

A public name sets our flag's attribute (`--pickscore-num-workers 4` is `--rm-num-workers 4`), so
the last occurrence of either spelling wins, as for any repeated flag. Torch-free.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from miles.flags.value_types import dtype_word


_ENGINES = ("rollout runs in this project's own engines (miles.rollout.engine, placed by --rollout-num-gpus and "
            "--rollout-num-gpus-per-engine, in --rollout-dtype); drop the flag")
# flag prefix -> what runs here instead (one line each)
REFUSED_PREFIXES: dict[str, str] = {
    "--sglang-": f"sglang diffusion servers do not run here: {_ENGINES}",
    "--apply-sgld-monkey-patches": f"sglang diffusion servers do not run here: {_ENGINES}",
    "--diffusion-generator-device": f"sglang's POST /rollout/generate is not used here: {_ENGINES}",
    "--rollout-health-check-": f"there are no engine servers to health-check here: {_ENGINES}; a stuck engine "
                               "is caught by the remote-call deadlines (--remote-timeout-*)",
    "--use-fault-tolerance": "engine-server fault tolerance has no meaning here: infrastructure failures are "
                             "handled by the launcher's --max-restarts (docs/faults.md)",
    "--use-miles-router": "the miles router does not run here: the driver hands each engine its prompt groups "
                          "directly (miles.ray.rollout_manager)",
    "--miles-router-": "the miles router does not run here: the driver hands each engine its prompt groups "
                       "directly (miles.ray.rollout_manager)",
    "--router-": "the sglang router does not run here: the driver hands each engine its prompt groups directly",
    "--rm-url": "remote reward servers are not called here: rewards run in Ray reward workers (--rm-type, "
                "--custom-rm-path)",
    "--megatron-": "Megatron does not run here: train ranks are this project's FSDP/DP ranks (--train-backend)",
    "--tensor-model-parallel-size": "Megatron does not run here: train ranks are this project's FSDP/DP ranks "
                                    "(--train-backend)",
    "--wandb-key": "the wandb key never travels on a command line here; export WANDB_API_KEY and the launcher "
                   "hands it to the job's environment",
}


def refusal(flag: str) -> str | None:
    """Why `flag` is refused (what runs here instead), or None for a flag that is simply unknown."""
    from miles.flags import foreign_flags

    name = flag.split("=", 1)[0]
    why = foreign_flags.refusal(name)
    if why is not None:
        return why
    if name in foreign_flags.NO_COUNTERPART:  # the launcher leaves these out of a job's argv
        return f"{foreign_flags.NO_COUNTERPART[name]}; a launch script's copy is left out by the launcher"
    for prefix, why in REFUSED_PREFIXES.items():
        if name == prefix or (prefix.endswith("-") and name.startswith(prefix)):
            return why
    return None


def unrecognized_message(extras: Sequence[str], known_flags: Sequence[str]) -> str:
    """One line: the first refused flag and what runs here instead; else every unknown flag, each
    with the closest known one. A refused flag's value is never shown (it may be a secret)."""
    import difflib

    for token in extras:
        refused = refusal(token) if token.startswith("--") else None
        if refused:
            return f"{token.split('=', 1)[0]} does not run here: {refused}"
    described = []
    for token in extras:
        close = []
        if token.startswith("-"):
            close = difflib.get_close_matches(token.split("=", 1)[0], known_flags, n=1, cutoff=0.6)
        described.append(f"{token} (did you mean {close[0]}?)" if close else token)
    return f"unrecognized arguments: {' '.join(described)}"


class PublicName(argparse.Action):
    """A public name: sets our flags' attributes (`targets`) to the converted value, or `const`."""

    def __init__(self, option_strings, dest, targets: Sequence[str] = (), convert: Callable | None = None,
                 **kwargs: Any):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)
        self.targets = tuple(targets)
        self.convert = convert

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        if self.convert is not None:
            try:
                value = self.convert(value)
            except (argparse.ArgumentTypeError, ValueError) as err:
                parser.error(f"argument {option_string}: {err}")
        for target in self.targets:
            setattr(namespace, target, value)




EVERY_STEP = -1  # `--diffusion-sde-window-size 0`, resolved to --diffusion-num-steps once both are parsed


def _sde_window_size(value: str) -> int:
    from miles.flags.value_types import non_negative_int

    # 0: no window, every step is an SDE step and trained -- explicitly all of them, since an unset
    # --diffusion-num-sde-steps means the reference's fraction of the steps (docs/algorithms.md)
    return non_negative_int(value) or EVERY_STEP


def _sde_window_range(value: str) -> tuple[int, int]:
    """miles-diffusion's 'lo,hi': the window lies in steps lo..hi-1 (it starts in lo..hi - its size),
    resolved into --diffusion-sde-window-min-start / -max-start once the window size is known."""
    try:
        lo, hi = (int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'lo,hi', got {value!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"{value!r}: want 0 <= lo < hi (the window lies in steps lo..hi-1)")
    return lo, hi


def add_public_flags(parser: argparse.ArgumentParser) -> None:
    """miles-diffusion's names for flags we have, each setting ours."""
    from miles.flags.value_types import non_negative_float, positive_int
    from miles.flags.reward_names import rm_type

    g = parser.add_argument_group(
        "miles-diffusion names", "train_diffusion.py flags of miles-diffusion, same meaning, each setting the "
        "flag named in its help (docs/launch-scripts.md lists them)")

    def alias(flag: str, targets: Sequence[str], help: str, **kwargs: Any) -> None:
        g.add_argument(flag, action=PublicName, targets=targets, help=help, **kwargs)

    alias("--diffusion-forward-dtype", ("compute_dtype", "rollout_dtype"), convert=dtype_word, metavar="fp16|bf16|fp32",
          help="dtype of every DiT forward, train and rollout: --compute-dtype and --rollout-dtype")
    alias("--fsdp-master-dtype", ("param_dtype",), convert=dtype_word, metavar="fp16|bf16|fp32",
          help="dtype of the trained (master) weights: --param-dtype")
    alias("--pickscore-num-workers", ("rm_num_workers",), type=positive_int, metavar="N",
          help="PickScore reward workers: --rm-num-workers")
    alias("--ocr-num-workers", ("rm_num_workers",), type=positive_int, metavar="N",
          help="OCR reward workers: --rm-num-workers")
    alias("--pickscore-num-gpus-per-worker", ("rm_num_gpus_per_worker",), type=non_negative_float, metavar="X",
          help="GPU fraction per PickScore worker: --rm-num-gpus-per-worker")
    alias("--diffusion-reward", ("rm_type",), type=rm_type, metavar="NAME", help="the reward: --rm-type")
    alias("--diffusion-microgroup-size", ("rollout_microgroup_size",), type=positive_int, metavar="N",
          help="samples of a prompt generated together: --rollout-microgroup-size")
    alias("--diffusion-negative-prompt", ("negative_prompt",), metavar="TEXT", help="--negative-prompt")
    alias("--diffusion-device", ("device",), choices=("cuda", "cpu"), help="where models run: --device")
    alias("--diffusion-sde-window-size", ("diffusion_num_sde_steps",), convert=_sde_window_size, metavar="N",
          help="SDE steps per sample in the window, trained (0: all): --diffusion-num-sde-steps")
    alias("--diffusion-sde-window-range", ("diffusion_sde_window_range",), convert=_sde_window_range,
          metavar="LO,HI", help="the window lies in steps LO..HI-1: --diffusion-sde-window-min-start LO and "
          "--diffusion-sde-window-max-start HI minus the window size")
    alias("--debug-train-only", ("train_only",), nargs=0, const=True, help="--train-only")
    alias("--offload", ("offload_train", "offload_rollout"), nargs=0, const=True,
          help="--offload-train and --offload-rollout")
    from miles.flags.upstream_values import add_upstream_aliases

    add_upstream_aliases(alias)


def normalize_public_values(namespace: argparse.Namespace) -> None:
    """Values whose public form differs in shape: `--diffusion-sde-window-size 0` becomes every step;
    `--eval-prompt-data [NAME] PATH` becomes the path, with the name kept as `eval_prompt_name` (eval
    metrics are also logged under it)."""
    if getattr(namespace, "diffusion_num_sde_steps", None) == EVERY_STEP:
        namespace.diffusion_num_sde_steps = namespace.diffusion_num_steps
    from miles.flags.upstream_values import normalize_upstream_values

    normalize_upstream_values(namespace)
    value = getattr(namespace, "eval_prompt_data", None)
    if isinstance(value, (list, tuple)):
        if len(value) > 2:
            from miles.flags.batch_rules import ConfigError

            raise ConfigError(f"--eval-prompt-data {' '.join(value)}: one eval set here, as PATH or NAME PATH")
        namespace.eval_prompt_name = value[0] if len(value) == 2 else None
        namespace.eval_prompt_data = value[-1]
    elif not hasattr(namespace, "eval_prompt_name"):
        namespace.eval_prompt_name = None
