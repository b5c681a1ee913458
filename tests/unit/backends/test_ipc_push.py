"""The push buffer's lifetime on the CPU (miles.backends.ipc_push): an engine that is killed, as
Ray kills actors at a run's end, leaves nothing in /dev/shm behind it."""

import multiprocessing
import os
from pathlib import Path

import torch

from miles.backends.ipc_push import IpcSender, open_shared
from miles.backends.weight_buckets import plan_buckets


def _segments_made_here() -> set[str]:
    # ours are miles_push_<pid>_*; torch's file_system ones, which the push used before, torch_<pid>_*
    return {p.name for pattern in (f"miles_push_{os.getpid()}_*", f"torch_{os.getpid()}_*")
            for p in Path("/dev/shm").glob(pattern)}


def _engine_killed_after_opening(handle, opened, value) -> None:
    buffer = open_shared(handle)
    opened.set()
    value.value = int(buffer[0])  # written by the rank before it opened: the same memory
    os._exit(0)  # no destructor runs: a SIGKILLed actor closes nothing either


def test_a_killed_engine_leaves_no_shared_segment_behind():
    before = _segments_made_here()
    weights = [("transformer", "w", torch.ones(64))]
    sender = IpcSender(plan_buckets(weights, torch.float32, 1 << 10), torch.device("cpu"))
    sender.buffer[0] = 7
    ctx = multiprocessing.get_context("spawn")
    opened, value = ctx.Event(), ctx.Value("i", -1)
    engine = ctx.Process(target=_engine_killed_after_opening, args=(sender.handle, opened, value))
    engine.start()
    assert opened.wait(120)
    sender.opened()
    engine.join(60)
    assert value.value == 7
    del sender
    assert _segments_made_here() == before
