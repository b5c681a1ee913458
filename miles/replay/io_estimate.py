"""Push time per rollout and save stall per checkpoint of a recipe's GPU run, before and after issue 41.

    python3 -m miles.replay.io_estimate [scripts/run_*.py ...]   (default: every GPU recipe, full scale)

Bytes come from the memory plan (the update in the rollout dtype; each rank's checkpoint tensors,
`RoleEstimate.saved`); rates are the documented constants below, so each figure is bytes over a
rate, no finer than the rate it assumes. Before: the colocated push went through host memory, rank
0 broadcasting every bucket over gloo to every engine, and the save was written while training
waited. After: each rank hands its own engines an IPC handle of one buffer (two device copies of
the update per rank, the ranks in parallel), and training waits only for the checkpoint's copy to
host memory; the write goes on in the background. A sharded (fsdp) update is all-gathered first,
before and after alike.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
# measured: gloo broadcast over this machine's loopback, 2 ranks 1.96 GB/s, 4 ranks 0.83 GB/s (issue 41);
# a group of rank 0 and 8 or 16 engines is no faster than 4, so the 4-rank figure is the likelier one
GLOO_GBPS = (0.83, 1.96)
# NVIDIA H100 SXM / H200 SXM datasheets: HBM3 3.35 TB/s, HBM3e 4.8 TB/s; a copy reads and writes every
# byte, so a device-to-device copy moves at most half of it
HBM_GBPS = {"H100": 3350.0, "H200": 4800.0}
NVLINK_GBPS = 450.0  # NVLink 4 (H100/H200 SXM): 900 GB/s both directions together, 450 each way
IB_GBPS = 50.0  # NDR InfiniBand, 400 Gb/s per NIC, one NIC per GPU as in a DGX H100/H200
PCIE_GBPS = 64.0  # PCIe Gen5 x16, one direction, by the spec: the device-to-host copy's ceiling
# an assumption: one data-center NVMe Gen4 drive writes 2-4 GB/s sequentially by its datasheet, and the
# node's train ranks share it; a network filesystem may be slower. Stated at 2 GB/s per node
DISK_GBPS = 2.0


@dataclass
class IoEstimate:
    recipe: str
    gpu: str
    update_gb: float  # one push, in the rollout dtype
    gather_s: float  # fsdp: each rank's share of the all-gather (both before and after)
    push_before_s: tuple[float, float]  # (at 1.96 GB/s, at 0.83 GB/s: the likelier)
    push_after_s: float
    saved_gb_per_rank: float
    node_write_s: float  # the node's share of a checkpoint written at DISK_GBPS
    stall_before_s: float
    stall_after_s: float
    colocated: bool

    def lines(self) -> list[str]:
        fast, slow = self.push_before_s
        if self.update_gb == 0:
            push = "  push per rollout: none (no rollout engines)"
        elif self.colocated:
            push = (f"  push per rollout: {_n(self.update_gb)} GB; before (gloo through the host) {_n(fast)}-{_n(slow)} s, "
                    f"after (IPC, device to device) {_n(self.push_after_s)} s")
        else:
            push = f"  push per rollout: {_n(self.update_gb)} GB over the NCCL broadcast, before and after {_n(self.push_after_s)} s"
        if self.gather_s and self.update_gb:
            push += f" (of which the fsdp all-gather {_n(self.gather_s)} s)"
        save = (f"  save stall per checkpoint: {_n(self.saved_gb_per_rank)} GB per rank; before (written while "
                f"training waits, {DISK_GBPS:g} GB/s per node) {_n(self.stall_before_s)} s, after (the host copy "
                f"over PCIe) {_n(self.stall_after_s)} s, the write ({_n(self.node_write_s)} s) in the background: "
                f"the next save waits for it only if it comes sooner")
        return [f"{self.recipe} ({self.gpu}, rates: miles/replay/io_estimate.py):", push, save]


def _n(x: float) -> str:
    """Two significant digits: the rates are not known better."""
    return f"{x:.2g}" if x < 100 else f"{x:.0f}"


def estimate(ns, plan, recipe: str) -> IoEstimate:
    from miles.plan.memory_plan import GEOMETRY, _lora_params, _train_rank, _trained, model_facts
    from miles.plan.model_facts import DTYPE_BYTES
    from miles.flags.validation import has_rollout_engines

    facts = model_facts(ns.hf_checkpoint)
    geo = GEOMETRY[ns.diffusion_model_family]
    trained = _trained(ns, facts)
    params = _lora_params(ns, facts, geo, trained) if ns.use_lora else sum(facts.components[n].params for n in trained)
    update = params * DTYPE_BYTES[ns.rollout_dtype] / GB if has_rollout_engines(ns) else 0.0
    gpu = "H200" if (ns.gpu_memory_gb or 0) > 100 else "H100"
    ranks, nodes = ns.actor_num_nodes * ns.actor_num_gpus_per_node, ns.actor_num_nodes
    sharded = getattr(ns, "train_backend", "dp") == "fsdp"
    link = IB_GBPS if nodes > 1 else NVLINK_GBPS
    gather = update * (ranks - 1) / ranks / link if sharded and ranks > 1 else 0.0
    copy = HBM_GBPS[gpu] / 2
    if ns.colocate:
        before = (gather + update / GLOO_GBPS[1], gather + update / GLOO_GBPS[0])
        after = gather + 2 * update / copy  # into the rank's buffer, out of it into the engine's weights
    else:
        after = gather + update / link
        before = (after, after)
    saved = _train_rank(ns, plan, facts, geo)[0].saved / GB
    writers = ns.actor_num_gpus_per_node if sharded else 1  # dp: rank 0 alone writes
    node_write = saved * writers / DISK_GBPS
    host_copy = saved / PCIE_GBPS  # every rank over its own link, at once
    return IoEstimate(recipe, gpu, update, gather, before, after, saved, node_write,
                      stall_before_s=host_copy + node_write, stall_after_s=host_copy, colocated=bool(ns.colocate))


def recipe_estimate(path: Path, scale: str = "full") -> IoEstimate:
    from miles.replay.recipe import recipe_flags

    ns, plan = recipe_flags(path, scale)
    return estimate(ns, plan, path.name)


def main(argv: list[str] | None = None) -> int:
    from miles.replay.doc_table import cases, repo_root

    root = repo_root()
    paths = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or sorted(
        {root / script for script, scale in cases(root) if scale == "full"})
    print(__doc__.splitlines()[0])
    for path in paths:
        print("\n".join(recipe_estimate(path).lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
