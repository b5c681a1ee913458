"""miles-diffusion's train_diffusion.py flags by one rule: each has one treatment here.

    same            the same name and meaning (a flag of our parser; its test observes its effect)
    mapped          maps onto ours (a public name of `public_flags` / `upstream_values`, or a value
                    written the way miles-diffusion writes it); the launch plan shows the mapping
    no counterpart  tunes only the speed or memory of miles-diffusion's sglang servers, router or
                    response parsing, which do not run here: the launcher leaves it out of the
                    job's argv and lists it in the plan (never a flag that changes what is computed)
    refused         one line naming what runs here instead

`translate(argv)` is what the launcher applies to an assembled argv. docs/launch-scripts.md shows
the table (tests/unit/flags/test_flag_vocabulary.py keeps the two equal). Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

SAME, MAPPED, NO_COUNTERPART, REFUSED = "same", "mapped", "no counterpart", "refused"

_SERVER = "miles-diffusion's sglang servers do not run here: rollout is this project's engines, which run the train ranks' forward"
_ROUTER = ("the miles router does not run here: the driver hands each engine its prompt groups directly "
           "(miles.ray.rollout_manager)")
_PARSER = "the parsing of sglang server responses does not run here: engines hand back tensors"
_ONE_GPU = ("an engine here runs on one GPU (--rollout-num-gpus-per-engine 1; more engines, not bigger ones); "
            "fix: 1, or drop the flag")

# flag -> why it has no counterpart (what it tunes, and why that does not run here)
NO_COUNTERPART: dict[str, str] = {
    "--use-miles-router": _ROUTER,
    "--miles-router-health-check-failure-threshold": f"router health checks; {_ROUTER}",
    "--rollout-health-check-interval": f"engine server health checks; {_SERVER} (a stuck engine is caught by "
                                       f"--remote-timeout-*)",
    "--sglang-server-concurrency": f"requests an sglang server runs at once (speed); {_SERVER}",
    "--sglang-attention-backend": f"the sglang server's attention kernel (speed); {_SERVER}",
    "--sglang-vae-slicing": f"sglang VAE slicing (memory); {_SERVER}",
    "--sglang-vae-cpu-offload": f"sglang VAE offload (memory); {_SERVER}",
    "--sglang-text-encoder-cpu-offload": f"sglang text encoder offload (memory); {_SERVER}",
    "--sglang-cpu-offload-components": f"sglang component offload (memory); {_SERVER}",
    "--sglang-model-id": f"the name an sglang server serves its model under; {_SERVER}",
    "--sglang-tp-size": f"an sglang server's tensor parallelism, 1 here; {_SERVER}",
    "--sglang-sp-degree": f"an sglang server's sequence parallelism, 1 here; {_SERVER}",
    "--sglang-ulysses-degree": f"an sglang server's Ulysses degree, 1 here; {_SERVER}",
    "--sglang-ring-degree": f"an sglang server's ring-attention degree, 1 here; {_SERVER}",
    "--rollout-parser-num-workers": f"workers parsing server responses (speed); {_PARSER}",
    "--rollout-fetch-in-parser": f"where server responses are fetched (speed); {_PARSER}",
}
# no-counterpart flags whose only value here is 1 (what an engine of ours is); another is refused
ONE_ONLY = ("--sglang-tp-size", "--sglang-sp-degree", "--sglang-ulysses-degree", "--sglang-ring-degree")

_REWARDS = "rewards here: --rm-type (a built-in: brightness, color_match, ocr, pickscore) or --custom-rm-path pkg.mod:fn"
_H3 = "MiniMax-H3 does not run here (no family of this project runs it; --diffusion-model-family lists those)"
# flag (or prefix ending in '-') -> what runs here instead
REFUSED: dict[str, str] = {
    "--hps-": f"the HPS reward does not run here; {_REWARDS}",
    "--api-rm-config": f"API rewards (a remote model scoring images) do not run here; {_REWARDS}",
    "--custom-rm-args": f"miles-diffusion's weighted reward mixture does not run here; {_REWARDS}",
    "--fsdp-attention-backend": "train ranks here run the diffusers attention the engines run (their forwards are one "
                                "code path, parity exact); no other kernel is chosen; drop the flag",
    "--fsdp-cpu-offload": "FSDP's CPU offload does not run here; with --colocate, --offload-train keeps the train "
                          "state in host memory between train steps",
    "--sft-offload-encoder": "SFT here encodes items with --hf-checkpoint's own VAE and text encoder on the train "
                             "ranks; there is no encoder pool to drop between rounds",
    "--diffusion-audio-flow-shift": _H3,
    "--diffusion-h3-": _H3,
    "--wan-controlnet-": "a Wan ControlNet branch does not run here (no family of this project trains one)",
}


def _matches(flag: str, table: dict[str, str]) -> str | None:
    for name, why in table.items():
        if flag == name or (name.endswith("-") and flag.startswith(name)):
            return why
    return None


def refusal(flag: str) -> str | None:
    """What runs here instead of a refused flag, or None."""
    return _matches(flag.split("=", 1)[0], REFUSED)


class FlagRefused(ValueError):
    """One line: a miles-diffusion flag or value that does not run here, and what does."""


@dataclass
class Translation:
    """An argv as the job gets it, with what the launch plan says about miles-diffusion's flags."""

    argv: list[str]
    mapped: list[str] = field(default_factory=list)  # "<given words> -> <ours>"
    no_counterpart: list[str] = field(default_factory=list)  # "<given words>: <why>"

    def plan_entry(self) -> dict[str, list[str]]:
        entry = {"mapped": self.mapped, "no_counterpart": self.no_counterpart}
        return {k: v for k, v in entry.items() if v}


def flag_groups(argv: list[str]) -> list[list[str]]:
    """`--flag values...` groups in order; words before the first flag are a group of their own."""
    groups: list[list[str]] = []
    for word in argv:
        if word.startswith("--") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def translate(argv: list[str]) -> Translation:
    """Leave out the no-counterpart flags (FlagRefused for a value they cannot take here) and list
    every mapped flag with what it maps onto."""
    kept: list[str] = []
    out = Translation(kept)
    aliases = alias_meanings()
    for group in flag_groups(argv):
        flag, values = group[0].split("=", 1)[0], _values(group)
        why = NO_COUNTERPART.get(flag)
        if why is not None:
            if flag in ONE_ONLY and values not in (["1"], []):
                raise FlagRefused(f"{flag} {' '.join(values)}: {_ONE_GPU}")
            out.no_counterpart.append(f"{' '.join(group)}: {why}")
            continue
        kept += group
        meaning = aliases.get(flag) or value_mapping(flag, values)
        if meaning:
            out.mapped.append(f"{' '.join(group)} -> {meaning}")
    return out


def _values(group: list[str]) -> list[str]:
    head, eq, inline = group[0].partition("=")
    return [inline] if eq else group[1:]


def alias_meanings() -> dict[str, str]:
    """Each public name of the parser -> the help naming what it sets here."""
    from miles.flags.arguments import build_parser
    from miles.flags.public_flags import PublicName

    return {flag: action.help for action in build_parser()._actions if isinstance(action, PublicName)
            for flag in action.option_strings}


def value_mapping(flag: str, values: list[str]) -> str | None:
    """A flag of ours given a value in miles-diffusion's spelling: what the value is here."""
    from miles.flags.upstream_values import SFT_LOSS_FUNCTION, STEP_STRATEGY_HUB

    value = " ".join(values)
    if flag == "--diffusion-step-strategy-path" and value.startswith(STEP_STRATEGY_HUB):
        return f"the built-in {value[len(STEP_STRATEGY_HUB):]}"
    if flag == "--diffusion-train-iter-order" and "_" in value:
        return value.replace("_", "-")
    if flag == "--update-weight-target-module" and "," in value:
        return " ".join(m for m in value.split(",") if m)
    if flag == "--custom-loss-function-path" and value == SFT_LOSS_FUNCTION:
        return "--loss-type sft_loss's own SFT loss"
    return None


def treatment(flag: str, parser: argparse.ArgumentParser | None = None) -> str:
    """SAME, MAPPED, NO_COUNTERPART or REFUSED for one flag name (an unknown flag is REFUSED)."""
    if flag in NO_COUNTERPART:
        return NO_COUNTERPART
    if flag in alias_meanings():
        return MAPPED
    from miles.flags.arguments import build_parser

    known = {f for action in (parser or build_parser())._actions for f in action.option_strings}
    return SAME if flag in known else REFUSED
