#!/usr/bin/env python3
"""Peak memory of one train forward+backward with and without --gradient-checkpointing.

The CPU proxy: the tiny sd3 transformer on a larger latent (default 256x256 pixels, so the
activations, not the weights, dominate), one train pair through `TrainRank._micro_batch_loss`
and backward, each setting in its own fresh process. What checkpointing saves is the activation
memory the autograd graph holds from the forward until the backward: measured on any device as
the bytes of the distinct storages the graph saves (a `saved_tensors_hooks` pack hook, which sees
what the checkpointed blocks keep: their inputs, not their insides); on a GPU also the peak of
torch.cuda.max_memory_allocated over the step. Prints one table.

    python3 benchmarks/bench_gradient_checkpointing.py [--size 256] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(size: int, checkpointing: bool, device: str) -> dict:
    sys.path[:0] = [str(REPO), str(REPO / "tests/unit/backends")]
    import torch
    from dtype_helpers import one_rollout, tiny_args

    from miles.backends.actor import TrainRank
    from miles.flags.batching import Pair

    run_dir = tempfile.mkdtemp()
    extra = f"--diffusion-height {size} --diffusion-width {size} --device {device}"
    extra += " --gradient-checkpointing" if checkpointing else ""
    args, plan = tiny_args(run_dir, extra)
    batch = one_rollout(tiny_args(run_dir, f"--diffusion-height {size} --diffusion-width {size}")[0], 0)
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    with torch.no_grad():  # warm the allocator and the caches outside the measurement
        rank._micro_batch_loss(batch, [Pair(0, 0)], None, None)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    storages: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = rank._micro_batch_loss(batch, [Pair(0, 0)], None, None)
    params = set()
    for p in (q for m in rank.fmodel.transformers.values() for q in m.parameters()):
        params.add(p.untyped_storage().data_ptr())
    saved = sum(n for ptr, n in storages.items() if ptr not in params)  # activations, not weights
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    return {"checkpointing": checkpointing, "saved_activation_bytes": saved, "cuda_peak_step_bytes": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=("on", "off"))
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(measure(ns.size, ns.child == "on", ns.device)))
        return 0
    rows = []
    for setting in ("off", "on"):
        out = subprocess.run([sys.executable, __file__, "--size", str(ns.size), "--device", ns.device,
                              "--child", setting], check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    off, on = rows[0]["saved_activation_bytes"], rows[1]["saved_activation_bytes"]
    print(f"{'gradient checkpointing':<24}{'activations held for backward (MiB)':>38}{'CUDA peak of the step (MiB)':>30}")
    for row in rows:
        cuda = "-" if row["cuda_peak_step_bytes"] is None else f"{row['cuda_peak_step_bytes'] / 2**20:.1f}"
        print(f"{'on' if row['checkpointing'] else 'off':<24}{row['saved_activation_bytes'] / 2**20:>38.1f}{cuda:>30}")
    print(f"drop: {(1 - on / off) * 100:.0f}% ({ns.device}, {ns.size}x{ns.size} pixels, tiny sd3, one train pair)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
