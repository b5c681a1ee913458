#!/usr/bin/env python3
"""Probe of the colocated weight push through CUDA IPC, for the GPU check (docs/ci.md).

Drives the push path's own two ends (miles.backends.ipc_push): `IpcSender` packs each bucket of
a `plan_buckets` plan into its one reused buffer and shares the buffer's handle
(torch.multiprocessing's reductions); an engine process rebuilds it with `IpcReceiver`, copies
each bucket into its tensors in place and acknowledges before the sender overwrites the buffer.

    python3 ci/ipc_push_probe.py --device cuda      # stage 1 of ci/gpu_check.sh: CUDA IPC
    python3 ci/ipc_push_probe.py --device cpu       # the same code; CPU tensors travel as
                                                    # named shared memory

Prints the largest difference between what was sent and what arrived (must be exactly 0.0) and
exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import io
import sys

import torch
import torch.multiprocessing as mp

BUCKET_BYTES = 1 << 18
DTYPES = (torch.float32, torch.bfloat16)


def weights(seed: int, device: str) -> dict[str, torch.Tensor]:
    """Stand-in weights of the two dtypes a push carries, of sizes that straddle buckets (one
    bigger than a bucket)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (300, 129), "a.bias": (129,), "b.weight": (77, 513), "c.lora_A": (16, 1000),
              "d.weight": (300, 300)}
    return {f"{name}.{str(dtype).split('.')[-1]}": torch.randn(shape, generator=g).to(dtype).to(device)
            for dtype in DTYPES for name, shape in shapes.items()}


class Holder(torch.nn.Module):
    """The engine's weights: zeros of the sent shapes and dtypes, as parameters of one component."""

    def __init__(self, like: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in like.items():
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))


def plan_for(sent: dict[str, torch.Tensor]):
    from miles.backends.weight_buckets import plan_buckets

    # each tensor travels in its own dtype here (the engine dtype rule is the push path's, not the probe's)
    by_dtype = {dtype: [("transformer", n.replace(".", "_"), t) for n, t in sent.items() if t.dtype == dtype]
                for dtype in DTYPES}
    plans = [plan_buckets(entries, dtype, BUCKET_BYTES) for dtype, entries in by_dtype.items()]
    return type(plans[0])(BUCKET_BYTES, tuple(b for p in plans for b in p.buckets))


def receiver(device: str, handle: bytes, plan, channel, acks, result) -> None:
    """The engine's end: rebuild the buffer from its handle, copy each bucket in place, acknowledge."""
    from miles.backends.ipc_push import IpcReceiver

    holder = Holder(weights(0, device))
    engine = IpcReceiver(handle, plan, {"transformer": holder})
    acks.put("opened")
    engine.begin()
    while (index := channel.get()) is not None:
        engine.receive(index)
        acks.put(True)
    buffer = io.BytesIO()  # back as bytes: a tensor would travel as a handle that dies with this process
    torch.save({n: p.detach().cpu() for n, p in holder.named_parameters()}, buffer)
    result.put(buffer.getvalue())


def push(device: str) -> float:
    from miles.backends.ipc_push import IpcSender

    sent = weights(0, device)
    plan = plan_for(sent)
    sender = IpcSender(plan, torch.device(device))
    ctx = mp.get_context("spawn")
    channel, acks, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=receiver, args=(device, sender.handle, plan, channel, acks, result))
    engine.start()
    try:
        assert acks.get(timeout=120) == "opened"
    finally:
        sender.opened()  # as the train rank does once its engines hold the buffer

    def deliver(index: int) -> None:
        channel.put(index)
        acks.get(timeout=120)  # the buffer is the engine's to read until it says so

    tensors = {("transformer", n.replace(".", "_")): t for n, t in sent.items()}
    sender.send(tensors, deliver)
    channel.put(None)
    received = torch.load(io.BytesIO(result.get(timeout=120)))
    engine.join(timeout=60)
    return max((received[n.replace(".", "_")].float() - t.cpu().float()).abs().max().item() for n, t in sent.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    diff = push(args.device)
    print(f"IPC weight push (miles.backends.ipc_push) on {args.device}: max abs difference {diff!r}")
    return 0 if diff == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
