"""train_diffusion.py's parse step: the flags (miles.flags.arguments), then the memory plan checked
against them; `--validate-only` prints both plans and exits. Torch-free.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from miles.flags.arguments import parse_and_plan
from miles.flags.batching import BatchPlan
from miles.flags.validation import ConfigError
from miles.plan.memory_plan import MemoryPlanError, plan_and_check


def parse_command_line(argv: Sequence[str] | None = None,
                       preflight: Callable[[argparse.Namespace], None] | None = None,
                       ) -> tuple[argparse.Namespace, BatchPlan]:
    """train_diffusion.py's parse step: exits 0 after --help/--validate-only, 1 on a ConfigError.
    `preflight(namespace)` (the caller's file checks) runs before --validate-only answers."""
    try:
        namespace, plan = parse_and_plan(argv)
    except ConfigError as error:
        print(f"train_diffusion.py: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        memory = plan_and_check(namespace, plan)
    except MemoryPlanError as error:
        print(plan.table())
        print(f"train_diffusion.py: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    if preflight is not None:
        preflight(namespace)
    if namespace.validate_only:
        print(plan.table())
        print(memory.table())
        raise SystemExit(0)
    return namespace, plan
