"""Launcher shapes beyond one execute(): a `_RECIPES` table picked by --model-name, and a
`full-train` pipeline whose steps leave a sentinel so a re-run resumes where it stopped."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from miles.launcher.launch_mode import is_dry_run
from miles.launcher.processes import write_text_atomically

R = TypeVar("R")
PIPELINE_DIR_NAME = ".pipeline"


class UnknownRecipeError(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def select_recipe(recipes: Mapping[str, R], name: str, option: str = "--model-name") -> R:
    """`_RECIPES[name]`, or an error that lists the names a user can pick."""
    try:
        return recipes[name]
    except KeyError:
        raise UnknownRecipeError(f"{option} {name!r} is not one of: {', '.join(recipes)}") from None


def sentinel_path(state_dir: str | Path, step: str) -> Path:
    return Path(state_dir) / f"{step}.done"


def pipeline_state_dir(output_dir: str | Path, pipeline: str = "full-train") -> Path:
    """Where sentinels live: under the output dir, stable across run ids, so a re-run finds them."""
    return Path(output_dir) / PIPELINE_DIR_NAME / pipeline


def run_pipeline(steps: Sequence[tuple[str, Callable[[], Any]]], state_dir: str | Path) -> list[str]:
    """Run the steps in order, skipping those whose sentinel exists. Returns the steps run.

    A sentinel is written (atomically) only after its step returns, so a step that failed or
    was interrupted runs again next time and the steps after it wait for it. A dry run runs
    every step that is not done (each step is itself dry) and writes no sentinel.
    """
    dry = is_dry_run()
    ran = []
    for name, step in steps:
        sentinel = sentinel_path(state_dir, name)
        if sentinel.exists():
            print(f"pipeline: step {name} already done ({sentinel}); skipping", flush=True)
            continue
        print(f"pipeline: running step {name}" + (" (dry run)" if dry else ""), flush=True)
        step()
        ran.append(name)
        if not dry:
            record = {"step": name, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            write_text_atomically(sentinel, json.dumps(record) + "\n")
    return ran
