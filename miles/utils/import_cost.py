"""Heavy imports without the cyclic garbage collector running through them.

Importing diffusers and transformers (and through them torch._dynamo and sympy) makes about 700,000
objects, and the collector's full passes over that growing heap are a fifth of the import's CPU
time: loading a tiny checkpoint after torch took 3.04 CPU-s with the collector on and 2.41 with it
paused (benchmarks/bench_import_cost.py, medians of 5 fresh processes on a 2-core machine). Every
engine, train rank and PickScore worker of a run pays that import once. Refcounting frees what the
import drops either way, and the collector runs again the moment the block ends.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block; left as it was found (a caller that paused it
    already keeps it paused)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
