"""The aligned recipe's --scale full argv carries every value of docs/algorithms.md's table of
flow_grpo's `pickscore_qwenimage` config (the table is parsed, so the doc and the recipe cannot drift)."""

import re
from pathlib import Path

import pytest

from miles.testing import RecipeCase
from miles.testing.dry import run_dry
from miles.utils.arguments import build_parser, parse_and_plan

REPO = Path(__file__).resolve().parents[3]
RECIPE = "scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py"
HEADING = "## The aligned recipe: `run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py`"


def reference_table() -> dict[str, str]:
    """flag -> value from the table under HEADING."""
    text = (REPO / "docs" / "algorithms.md").read_text()
    section = text[text.index(HEADING):]
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \| ([^|]+) \|", section, flags=re.M)
    assert len(rows) >= 20, "the table lost its rows"
    return {flag: value.strip() for flag, value in rows}


def expected(action, text: str):
    if text in ("on", "off"):
        return text == "on"
    if action.nargs == "+":
        return text.split()
    try:
        return float(text) if action.type is not None else text  # numeric flags compare as numbers
    except ValueError:
        return text


@pytest.fixture(scope="module")
def full_scale_args(tmp_path_factory):
    dry = run_dry(RecipeCase.dry(RECIPE, root=REPO), tmp_path_factory.mktemp("aligned"), rootdir=REPO)
    return parse_and_plan(dry.argv)[0]


def test_the_aligned_recipe_sets_every_value_of_the_reference_table(full_scale_args):
    actions = build_parser()._option_string_actions
    wrong = {}
    for flag, text in reference_table().items():
        action = actions[flag]
        want, got = expected(action, text), getattr(full_scale_args, action.dest)
        if isinstance(want, float) and not isinstance(got, bool):
            ok = got is not None and float(got) == pytest.approx(want, rel=1e-12)
        else:
            ok = got == want
        if not ok:
            wrong[flag] = (text, got)
    assert not wrong, f"recipe differs from docs/algorithms.md's table: {wrong}"
