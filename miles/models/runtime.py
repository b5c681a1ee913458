"""Torch process settings that engines and train ranks must share for their forwards to agree."""

from __future__ import annotations

import os

import torch

from miles.utils.import_cost import collector_paused

# CPU kernels may split reductions by thread count, so engines and train ranks must use the same one
CPU_THREADS_PER_ACTOR = 1


def actor_threads(device: str) -> int:
    """Torch threads of an engine or train rank on `device`: the CPU tier's pinned one, or a GPU
    process's documented host thread count (miles.utils.numerics.GPU_PROCESS_CPU_THREADS)."""
    from miles.utils.numerics import GPU_PROCESS_CPU_THREADS

    return CPU_THREADS_PER_ACTOR if device == "cpu" else GPU_PROCESS_CPU_THREADS


def configure_torch(deterministic: bool = False, num_threads: int | None = None) -> None:
    """Call once per process before any model runs.

    Engines and trainers use the same thread count: CPU kernels may split reductions by thread,
    so a different count can change the last bits of a forward.
    """
    if num_threads is not None:
        torch.set_num_threads(num_threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # only settable before the first parallel op; harmless if already set
            pass
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def quiet_libraries() -> None:
    """No progress bars from diffusers/transformers: engines and tests log to files."""
    with collector_paused():
        import diffusers
        import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
