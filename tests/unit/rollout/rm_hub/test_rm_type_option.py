"""Issue 11, point 4: --rm-type is checked against the registry at parse time and --help lists it."""

import pytest

from miles.rollout.rm_hub.registry import BUILTIN_REWARDS, reward_name
from miles.flags.arguments import build_parser, parse_and_plan

BASE = ["--hf-checkpoint", "x", "--diffusion-model-family", "sd3", "--prompt-data", "p.jsonl", "--num-rollout", "1"]


def test_a_misspelt_reward_is_refused_at_parse_time_with_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args([*BASE, "--rm-type", "brightnes"])
    assert exit.value.code == 2
    assert "did you mean 'brightness'?" in capsys.readouterr().err


def test_help_lists_every_builtin_reward_and_the_custom_contract():
    text = build_parser().format_help()
    assert all(name in text for name in BUILTIN_REWARDS)
    assert "custom" in text and "async def rm(args" in text


def test_rm_type_custom_with_a_custom_path_works_as_documented():
    ns, _ = parse_and_plan([*BASE, "--rm-type", "custom", "--custom-rm-path", "m:f"])
    assert reward_name(ns, {}) == "m:f"


def test_rm_type_custom_without_a_path_names_the_fix():
    with pytest.raises(ValueError, match="--rm-type custom needs --custom-rm-path"):
        parse_and_plan([*BASE, "--rm-type", "custom"])
