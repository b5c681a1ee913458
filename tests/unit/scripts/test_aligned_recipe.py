"""The recipes named after a reference config carry, at --scale full, every value of their table in
docs/algorithms.md: the aligned recipe flow_grpo's `pickscore_qwenimage`, the NFT recipe DiffusionNFT's
`sd3_pickscore` (the tables are parsed, so the doc and the recipes cannot drift)."""

import re
from pathlib import Path

import pytest

from miles.testing import RecipeCase
from miles.testing.dry import run_dry
from miles.flags.arguments import build_parser, parse_and_plan

REPO = Path(__file__).resolve().parents[3]
# recipe -> the heading of its table in docs/algorithms.md
RECIPES = {
    "scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py":
        "## The aligned recipe: `run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py`",
    "scripts/run_diffusion_nft_sd3_pickscore.py": "## The DiffusionNFT recipe: `run_diffusion_nft_sd3_pickscore.py`",
}


def reference_table(heading: str) -> dict[str, str]:
    """flag -> value from the table under `heading` (up to the next section)."""
    text = (REPO / "docs" / "algorithms.md").read_text()
    section = text[text.index(heading):]
    section = section[:section.find("\n## ", 3)] if "\n## " in section[3:] else section
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


@pytest.fixture(scope="module", params=sorted(RECIPES))
def full_scale_args(request, tmp_path_factory):
    dry = run_dry(RecipeCase.dry(request.param, root=REPO), tmp_path_factory.mktemp("aligned"), rootdir=REPO)
    return request.param, parse_and_plan(dry.argv)[0]


def test_a_recipe_named_after_a_reference_sets_every_value_of_its_table(full_scale_args):
    recipe, full_scale_args = full_scale_args
    actions = build_parser()._option_string_actions
    wrong = {}
    for flag, text in reference_table(RECIPES[recipe]).items():
        action = actions[flag]
        want, got = expected(action, text), getattr(full_scale_args, action.dest)
        if isinstance(want, float) and not isinstance(got, bool):
            ok = got is not None and float(got) == pytest.approx(want, rel=1e-12)
        else:
            ok = got == want
        if not ok:
            wrong[flag] = (text, got)
    assert not wrong, f"{recipe} differs from docs/algorithms.md's table: {wrong}"
