"""The training entry point: parse and validate the flags, show the batch plan, train.

Nothing at module level imports torch or Ray, so `--help` and `--validate-only` stay instant.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from typing import Sequence

from miles.utils.arguments import parse_command_line
from miles.utils.batching import BatchPlan


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, plan = parse_command_line(argv)
    except SystemExit as exit:  # --help, --validate-only, and every parse error end here
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    print(plan.table(), flush=True)
    return train(args, plan)


def train(args: Namespace, plan: BatchPlan) -> int:
    raise NotImplementedError("the training loop lands with issue 5")


if __name__ == "__main__":
    sys.exit(main())
