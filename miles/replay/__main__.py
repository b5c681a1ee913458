"""`python3 -m miles.replay scripts/<recipe>.py --scale <scale>`: the recipe's GPU run replayed on
meta tensors, each phase's measured peak beside the memory plan's estimate and the budget.

Exit 0 when every phase fits its budget and agrees with the plan within TOLERANCE, 1 when one
does not (the lines name the phase, the place, the roles and the largest tensors alive), 2 on
bad input. `--table` prints the rows of docs/memory-plan.md's replay table instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m miles.replay", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("recipe", help="a recipe script, e.g. scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py")
    parser.add_argument("--scale", default="full", help="a GPU scale of the recipe (full, gpu-proxy, 1gpu-proxy)")
    parser.add_argument("--depth", choices=("released", "extrapolated"), default="released",
                        help="released: every transformer at its own block count (minutes); extrapolated: "
                             "4 and 5 blocks, extended linearly to the released count (exact, seconds)")
    parser.add_argument("--table", action="store_true", help="print docs/memory-plan.md's table rows")
    ns = parser.parse_args(argv)
    from miles.replay.report import ReplayInputError, replay_recipe

    try:
        report = replay_recipe(ns.recipe, ns.scale, extrapolate=ns.depth == "extrapolated")
    except ReplayInputError as error:
        print(f"python3 -m miles.replay: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(report.table_rows() if ns.table else report.lines()))
    if not ns.table:  # beside the plan: what the run's pushes and saves cost in time
        from miles.replay.io_estimate import recipe_estimate

        print("\n".join(recipe_estimate(Path(ns.recipe), ns.scale).lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
