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

from miles.flags.foreign_flags import (  # noqa: F401 (the vocabulary's names)
    _ONE_GPU, MAPPED, NO_COUNTERPART, ONE_ONLY, REFUSED, SAME, refusal,
)


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
