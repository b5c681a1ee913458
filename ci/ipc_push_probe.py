#!/usr/bin/env python3
"""Probe of the colocated weight push through CUDA IPC, for the GPU check (docs/ci.md).

Today a colocated engine gets its weights from train rank 0 over gloo, staged through host memory
(miles/backends/sync_group.py: NCCL refuses two ranks on one device). miles-diffusion instead
hands the engine a CUDA IPC handle of the sender's buffer (torch.multiprocessing's reductions,
`reduce_tensor`), and the engine copies from the rebuilt tensor on the device. Before that path
is built here, this probe checks it on the machine the check runs on, with the protocol the push
would use: the sender packs each bucket of weights into one flat buffer that it reuses, sends
the buffer's handle, and overwrites the buffer only after the receiver has copied it out.

    python3 ci/ipc_push_probe.py --device cuda      # stage 1 of ci/gpu_check.sh
    python3 ci/ipc_push_probe.py --device cpu       # the same protocol; CPU tensors travel as
                                                    # shared memory (another transport)

Prints the largest difference between what was sent and what arrived (must be exactly 0.0) and
exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import io
import sys

import torch
import torch.multiprocessing as mp

BUCKET_ELEMENTS = 1 << 16
DTYPES = (torch.float32, torch.bfloat16)


def weights(seed: int, device: str) -> dict[str, torch.Tensor]:
    """Stand-in weights of the two dtypes a push carries, of sizes that straddle buckets."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (300, 129), "a.bias": (129,), "b.weight": (77, 513), "c.lora_A": (16, 1000)}
    return {f"{name}.{str(dtype).split('.')[-1]}": torch.randn(shape, generator=g).to(dtype).to(device)
            for dtype in DTYPES for name, shape in shapes.items()}


def buckets(names: list[str], tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Consecutive tensors of one dtype, up to BUCKET_ELEMENTS each (a larger tensor alone)."""
    out, current, size = [], [], 0
    for name in names:
        n = tensors[name].numel()
        if current and (size + n > BUCKET_ELEMENTS or tensors[current[0]].dtype != tensors[name].dtype):
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    return out + ([current] if current else [])


def receiver(device: str, channel, acks, result) -> None:
    """The engine's end: rebuild each bucket from its handle, copy it out, acknowledge."""
    received = {}
    while (message := channel.get()) is not None:
        flat, layout = message  # the flat buffer arrives as a rebuilt tensor on the same device
        offset = 0
        for name, shape in layout:
            n = torch.Size(shape).numel()
            received[name] = flat[offset:offset + n].view(shape).clone()
            offset += n
        del flat
        if device == "cuda":
            torch.cuda.synchronize()  # the copy is done before the sender may overwrite
        acks.put(True)
    # back as bytes: a tensor would travel as a handle that dies with this process
    buffer = io.BytesIO()
    torch.save({name: t.cpu() for name, t in received.items()}, buffer)
    result.put(buffer.getvalue())


def push(device: str) -> float:
    ctx = mp.get_context("spawn")
    channel, acks, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=receiver, args=(device, channel, acks, result))
    engine.start()
    sent = weights(0, device)
    staging = {dtype: torch.empty(BUCKET_ELEMENTS * 4, dtype=dtype, device=device) for dtype in DTYPES}
    for bucket in buckets(list(sent), sent):
        dtype = sent[bucket[0]].dtype
        size = sum(sent[n].numel() for n in bucket)
        if size > staging[dtype].numel():
            staging[dtype] = torch.empty(size, dtype=dtype, device=device)
        flat = staging[dtype][:size]  # a view at offset 0 of the reused buffer
        torch.cat([sent[n].reshape(-1) for n in bucket], out=flat)
        channel.put((flat, [(n, tuple(sent[n].shape)) for n in bucket]))
        acks.get(timeout=120)  # the buffer is the engine's to read until it says so
    channel.put(None)
    received = torch.load(io.BytesIO(result.get(timeout=120)))
    engine.join(timeout=60)
    if sorted(received) != sorted(sent):
        raise SystemExit(f"names differ: sent {sorted(sent)}, got {sorted(received)}")
    return max((received[n].float() - sent[n].cpu().float()).abs().max().item() for n in sent)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    diff = push(args.device)
    print(f"IPC weight push on {args.device}: max abs difference {diff!r}")
    return 0 if diff == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
