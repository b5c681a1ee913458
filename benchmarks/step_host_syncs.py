"""Host syncs per optimizer step, before and after issue 41, printed in one run.

    python3 benchmarks/step_host_syncs.py [--before REF]   (also run by benchmarks/bench_trainer.py)

A train step's device work after backward, on both train backends, for one Wan2.2 A14B expert
(its 1,095 parameters, shapes from the committed config, built on `meta`): the gradient clip, the
AdamW step, an EMA swap (the KL reference) and the EMA update, then the one read of the step's
gradient norm that its metrics make. Each op that would make the host wait for a GPU is counted
on `meta` tensors standing for device tensors (tests/tools/host_syncs.py). "before" is the same
script run against REF (default: the commit before push41 was merged into main), checked out in
a temporary `git worktree` that the run removes; "after" is this tree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = "c18334f^1"  # main's first parent of the push41 merge: dtype39 merged, push41 not yet
MODEL = "Wan2.2-T2V-A14B-Diffusers"


def expert_shapes() -> list[tuple[str, list[int]]]:
    """(name, shape) of every parameter of one Wan2.2 A14B expert, from the committed config."""
    import torch
    from diffusers import WanTransformer3DModel

    from miles.plan.model_table import RELEASED

    config = RELEASED[MODEL]["components"]["transformer"]["config"]
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    return [(n, list(p.shape)) for n, p in model.named_parameters()]


def count(shapes: list[tuple[str, list[int]]], counter_path: str) -> dict[str, int]:
    """Syncs of one step per backend, with whatever `miles` this process imports."""
    import importlib.util

    import torch

    from miles.backends import fsdp, optimizer
    from miles.backends.ema import EMA

    spec = importlib.util.spec_from_file_location("host_syncs", counter_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    class Adam:
        lr, adam_beta1, adam_beta2, adam_eps, weight_decay = 1e-4, 0.9, 0.999, 1e-8, 0.0

    def params(sharded: bool) -> dict[str, torch.nn.Parameter]:
        out = {}
        for name, shape in shapes:
            p = torch.nn.Parameter(torch.empty(shape, device=tool.DEVICE))
            p.grad = torch.empty_like(p)
            if sharded:  # a DTensor's gradient answers to_local(): here the whole tensor is the shard
                p.grad.to_local = (lambda g=p.grad: g)
            out[f"transformer.{name}"] = p
        return out

    syncs = {}
    for backend, clip in (("fsdp", fsdp.clip_gradients), ("dp", optimizer.clip_gradients)):
        named = params(sharded=backend == "fsdp")
        grouped = hasattr(optimizer, "param_groups")  # after: one AdamW group per block
        with tool.HostSyncCounter() as counter:
            ema = EMA(named, 0.99)
            with ema.swapped_in(named):
                pass
            norm = clip(list(named.values()), 1.0)
            optimizer.build_optimizer(list(named.items()) if grouped else list(named.values()), Adam).step()
            ema.update(named)
            float(norm)  # the step's metrics: the gradient norm read (before: a float already)
        syncs[backend] = len(counter.syncs)
    return syncs


def before(ref: str, shapes: list[tuple[str, list[int]]]) -> dict[str, int]:
    """The same count with `ref`'s miles, in a worktree removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="syncs-before-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref], check=True,
                       capture_output=True)
        try:
            data = Path(tmp) / "shapes.json"
            data.write_text(json.dumps(shapes))
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run([sys.executable, __file__, "--count", str(data)], cwd=tree, env=env, check=True,
                                 capture_output=True, text=True).stdout
            counts = json.loads(out.strip().splitlines()[-1])
            assert counts.pop("miles").startswith(str(tree)), "the 'before' count imported another tree's miles"
            return counts
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True,
                           capture_output=True)


def report(ref: str = BEFORE) -> None:
    shapes = expert_shapes()
    old, new = before(ref, shapes), count(shapes, str(REPO / "tests/tools/host_syncs.py"))
    print(f"host syncs per optimizer step, one {MODEL} expert ({len(shapes)} parameters; clip, AdamW, "
          f"EMA swap and update, the norm's read), before = {ref}, after = this tree:")
    for backend in ("fsdp", "dp"):
        print(f"  --train-backend {backend:4s}  before {old[backend]:5d}  after {new[backend]:5d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the git ref counted as 'before'")
    parser.add_argument("--count", help=argparse.SUPPRESS)  # the child: shapes file, prints the counts
    ns = parser.parse_args()
    if ns.count:
        import miles

        counts = count(json.loads(Path(ns.count).read_text()), str(REPO / "tests/tools/host_syncs.py"))
        print(json.dumps({**counts, "miles": miles.__file__}))
        return
    report(ns.before)


if __name__ == "__main__":
    main()
