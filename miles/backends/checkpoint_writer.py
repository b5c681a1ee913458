"""A rank's checkpoint write, off the critical path.

`begin` copies what the checkpoint holds to host memory while the caller waits (the only part a
train step waits for: a device-to-host copy, or a host copy on a CPU rank) and hands the writing
of the files to a background thread; training goes on while it writes. `BackgroundSave.done()`
asks without waiting, `wait()` waits and raises the writer's error. The rank never commits:
the driver renames the staging directory and moves `latest` (miles.backends.checkpoint.commit,
which fsyncs every file first) only once every rank's write has ended, so a kill at any moment
of a background write leaves the previous checkpoint whole and named, exactly as a synchronous
save did.

fsdp: DCP's own `async_save` (it stages every local shard on the host, then writes in a thread)
over a gloo group of its own, so the writer's collectives (plan exchange, the metadata gather)
never interleave with the training's on the default group. dp: rank 0 snapshots its whole
tensors and its optimizer state, and one thread writes them as a synchronous save would.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any, Callable

import torch

from miles.backends import checkpoint as ckpt
from miles.backends import fsdp


class BackgroundSave:
    """The futures of one rank's checkpoint write (none on a rank that writes nothing)."""

    def __init__(self, futures: list[concurrent.futures.Future] | None = None):
        self.futures = list(futures or [])

    def also(self, work: Callable[[], None]) -> None:
        """Count `work`, run on a thread of its own, as part of this write (fault injection)."""
        self.futures.append(_run_in_thread(work))

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        for future in self.futures:
            future.result()


def _run_in_thread(work: Callable[[], Any]) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-checkpoint")
    future = pool.submit(work)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future


def host_copy(value: Any) -> Any:
    """`value` with every tensor copied to the host (a structure of dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


def begin_whole(rank, staging: Path) -> BackgroundSave:
    """dp: rank 0 writes every tensor whole (safetensors) and its optimizer state; the others nothing."""
    if rank.rank != 0:
        return BackgroundSave()
    files: dict[str, dict[str, torch.Tensor]] = {}
    for component in rank.components:
        own = {n.split(".", 1)[1]: p for n, p in rank.params.items() if n.startswith(component + ".")}
        files[f"model_{component}.safetensors"] = host_copy(own)
        for prefix, kept in (("ema", rank.ema), ("old_policy", rank.old_policy)):
            if kept is not None:
                shadow = {n.split(".", 1)[1]: t for n, t in kept.shadow.items() if n.startswith(component + ".")}
                files[f"{prefix}_{component}.safetensors"] = host_copy(shadow)
    optimizer = host_copy({"optimizer": rank.optimizer.state_dict(), "optimizer_step": rank.optimizer_step})
    (staging / "rank0.json").write_text(json.dumps({"backend": "dp", "world_size": rank.world_size,
                                                    "lora": rank.lora is not None}))

    def write() -> None:
        for name, tensors in files.items():
            ckpt.save_tensors(staging / name, tensors)
        torch.save(optimizer, staging / "optimizer.pt")

    return BackgroundSave([_run_in_thread(write)])


def begin_sharded(rank, staging: Path) -> BackgroundSave:
    """fsdp: every rank's local shards through DCP's asynchronous save."""
    if getattr(rank, "checkpoint_group", None) is None:
        rank.checkpoint_group = new_checkpoint_group()  # every rank saves together: same order
    future = fsdp.save_sharded_async(staging, rank.rank, rank.world_size, rank.model, rank.components, rank.params,
                                     rank.optimizer, rank.ema, rank.optimizer_step, rank.lora is not None,
                                     rank.checkpoint_group)
    return BackgroundSave([future])


def new_checkpoint_group():
    """A gloo group of every rank for the writer's collectives (DCP's async save needs a CPU backend)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")
