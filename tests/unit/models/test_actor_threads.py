"""CPU ranks keep the pinned single thread; GPU ranks and engines get the documented host count."""

import torch

from miles.models.runtime import CPU_THREADS_PER_ACTOR, actor_threads, configure_torch
from miles.utils.numerics import GPU_PROCESS_CPU_THREADS, PINNED_THREADS


def test_cpu_processes_keep_the_pinned_thread_count_and_gpu_processes_get_their_own():
    assert actor_threads("cpu") == CPU_THREADS_PER_ACTOR == PINNED_THREADS == 1
    assert actor_threads("cuda") == GPU_PROCESS_CPU_THREADS > PINNED_THREADS


def test_configuring_a_gpu_process_overrides_the_jobs_one_thread():
    before = torch.get_num_threads()
    try:
        configure_torch(False, actor_threads("cuda"))
        assert torch.get_num_threads() == GPU_PROCESS_CPU_THREADS
    finally:
        torch.set_num_threads(before)
