"""A recipe's full argv at a scale, as its launcher assembles it, and the validated flags.

The recipe runs with submission off (`MILES_SCRIPT_ENABLE_RAY_SUBMIT=0`, the dry check's way:
miles.testing.dry), writes its plan.json, and the argv there goes through train_diffusion.py's
own parser and validator (`miles.flags.arguments.parse_and_plan`)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from miles.testing.cases import RecipeCase, find_repo_root
from miles.testing.dry import start_dry

GPU_SCALES = ("full", "gpu-proxy", "1gpu-proxy")


def recipe_scales(script: str | Path) -> list[str]:
    """The GPU scales a recipe offers (its `scale: Literal[...]` option), in its own order."""
    text = Path(script).read_text()
    found = re.search(r"scale:\s*Literal\[([^\]]*)\]", text)
    names = re.findall(r"\"([^\"]+)\"", found.group(1)) if found else []
    return [n for n in names if n in GPU_SCALES]


def recipe_flags(script: str | Path, scale: str):
    """(namespace, batch plan) of `script --scale scale`."""
    from miles.flags.arguments import parse_and_plan

    script = Path(script).resolve()
    root = find_repo_root(script)
    case = RecipeCase.dry(str(script.relative_to(root)), root=root, args=("--scale", scale))
    with tempfile.TemporaryDirectory(prefix="miles-replay-dry-") as out:
        dry = start_dry(case, out, rootdir=root).result()
        return parse_and_plan(dry.argv)
