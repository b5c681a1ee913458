"""How the backends tests start the ranks they run side by side: a fork of the test's own process,
which has imported torch and the trainer already, unless Ray has run here.

A spawned rank imports torch, diffusers and transformers again: 4-5 CPU-s each, most of what the
two FSDP ranks of tests/unit/backends/test_fsdp.py cost. An in-process Ray driver leaves threads
behind that must not be forked (some outlive `ray.shutdown()`), so after one the children come
from a fork server instead, which imports once for all of them.
"""

from __future__ import annotations

import multiprocessing

# what the ranks import first: the fork server's one import spares each child its own
FORK_SERVER_PRELOAD = ["torch", "torch.distributed.fsdp", "miles.backends.actor"]


def start_method(ray_ran_here: bool) -> str:
    if not ray_ran_here:
        return "fork"
    multiprocessing.get_context("forkserver").set_forkserver_preload(FORK_SERVER_PRELOAD)
    return "forkserver"


def process_context(ray_ran_here: bool) -> multiprocessing.context.BaseContext:
    return multiprocessing.get_context(start_method(ray_ran_here))
