#!/usr/bin/env python3
"""The GPU check's steps that ci/gpu_check.sh calls (docs/ci.md, "GPU check").

    python3 ci/gpu_check.py assets --scale gpu|cpu            # the cases' checkpoints, made once
    python3 ci/gpu_check.py suite --scale gpu|cpu OUT.json    # the cases as a --suite-json
    python3 ci/gpu_check.py run --scale gpu|cpu --out DIR     # one Ray cluster, the suite on shares
    python3 ci/gpu_check.py table DIR                         # the verdict table

The cases run at the same time on one GPU: the runner (ci/run_suite.py) splits the device into
shares and packs the cases onto it by the GPU memory each states here (ci/gpu_shares.py), on one
Ray cluster that declares the GPU (a logical one for --scale cpu, the CPU rehearsal, where the
same cases run at their CPU shapes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHARES = 100  # shares of the GPU: 1.4 GiB each on an H200
REHEARSAL_GPU_GIB = 139.0  # the H200 the rehearsal stands in for (its logical GPU has no memory)


@dataclass(frozen=True)
class CheckCase:
    gpu: str  # the GPU-tier case (tests/e2e)
    cpu: str  # the same recipe's CPU-tier case: the rehearsal's stand-in
    recipe: str
    scale: str | None  # the GPU case's --scale (None: the recipe has none)
    gpu_memory_gib: float  # what the whole case holds on the device, all its processes
    why: str


CASES = (
    CheckCase("run_diffusion_grpo_tiny_cpu-gpu", "run_diffusion_grpo_tiny_cpu-cpu",
              "scripts/run_diffusion_grpo_tiny_cpu.py", None, 4.0,
              "a tiny SD3 (MBs of weights): three CUDA contexts (rank, engine, driver) and the "
              "caching allocator's first blocks"),
    CheckCase("run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned-gpu-1gpu",
              "run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned-cpu",
              "scripts/run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned.py", "1gpu-proxy", 32.0,
              "train rank measured at 19.8 GiB (docs/memory-plan.md, H200), plus the engine's "
              "bf16 copy of the 3.2 B proxy (6.4 GB) and its activations, PickScore and three "
              "CUDA contexts"),
    CheckCase("run_diffusion_grpo_wan22_pickscore_5gpu-gpu-1gpu",
              "run_diffusion_grpo_wan22_pickscore_5gpu-cpu",
              "scripts/run_diffusion_grpo_wan22_pickscore_5gpu.py", "1gpu-proxy", 20.0,
              "train rank measured at 12.3 GiB (docs/memory-plan.md, H200), plus the engine's "
              "bf16 copy, PickScore and three CUDA contexts"),
    # Wan2.2 keeps modules in float32 under bfloat16: the family whose engine, trainer and push once
    # disagreed (issue 39); a full fine-tune of both experts pushes every one of them
    CheckCase("run_diffusion_grpo_wan22_pickscore_17gpu_multinode-gpu-1gpu",
              "run_diffusion_grpo_wan22_pickscore_17gpu_multinode-cpu-rehearsal",
              "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py", "1gpu-proxy", 46.0,
              "the memory plan's 42.7 GiB for the GPU (both proxy experts' float32 masters and AdamW "
              "state, the engine's bf16 copy, PickScore), plus the CUDA contexts it does not count"),
)


def case_names(scale: str) -> list[str]:
    return [c.gpu if scale == "gpu" else c.cpu for c in CASES]


# -- assets ----------------------------------------------------------------------------------

def load_recipe(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_assets(case: CheckCase, scale: str, model_dir: Path, data_dir: Path) -> float:
    """The recipe's own prepare() at the case's scale: what the case would make first, made
    ahead into the cache the harness hands every case (MILES_TEST_MODEL_DIR). Pinned numerics,
    as the recipe process pins them before its prepare(): a checkpoint built on the machine's own
    kernels and thread count has other weights, and the CPU cases miss their standards."""
    from miles.utils.numerics import pin_this_process

    pin_this_process()  # this is a fresh (spawned) process: torch is not loaded yet
    started = time.monotonic()
    recipe = load_recipe(case.recipe)
    options = {"model_dir": str(model_dir), "data_dir": str(data_dir)}
    if case.scale is not None:
        options["scale"] = case.scale if scale == "gpu" else "cpu-proxy"
    recipe.prepare(recipe.ScriptArgs(**options))
    return time.monotonic() - started


def assets(scale: str, model_dir: Path) -> int:
    data_dir = model_dir / "prefetch-data"
    # one process each: a checkpoint is CPU work, and imports racing in threads break diffusers
    with ProcessPoolExecutor(len(CASES), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {c.gpu: pool.submit(make_assets, c, scale, model_dir, data_dir) for c in CASES}
        for name, future in futures.items():
            print(f"assets of {name}: {future.result():.1f}s", flush=True)
    return 0


# -- the suite -------------------------------------------------------------------------------

def suite_entries(scale: str) -> list[dict]:
    """The check's cases from the harness's collection, each a one-GPU case with its memory
    (for --scale cpu: the CPU-tier sibling, on a share of the logical GPU)."""
    from ci.cases import collect_cases

    collected = {c.name: c for c in collect_cases("tests/e2e", REPO)}
    entries = []
    for check in CASES:
        name = check.gpu if scale == "gpu" else check.cpu
        if name not in collected:
            raise SystemExit(f"the harness has no case {name} (pytest tests/e2e --collect-only "
                             f"-q --miles-cases-json F lists them); update ci/gpu_check.py CASES")
        case = collected[name]
        entries.append({"name": name, "nodeid": case.nodeid, "gpus": 1, "est_time": case.est_time,
                        "timeout": case.timeout, "tier": case.tier,
                        "gpu_memory_gib": check.gpu_memory_gib})
    return entries


def device_gib(scale: str) -> float:
    if scale == "cpu":
        return REHEARSAL_GPU_GIB
    from ci.run_suite import nvml_gpu_memory_gib

    gib = nvml_gpu_memory_gib()
    if gib is None:
        raise SystemExit("NVML reads no GPU memory here: run the CPU rehearsal (--rehearse-cpu)")
    return gib


def run_suite(scale: str, out: Path, cpus: int) -> int:
    """One Ray cluster declaring the one GPU (logical on the CPU), the suite on its shares."""
    from miles.testing.cluster import LocalRayCluster

    if not os.environ.get("MILES_TEST_MODEL_DIR"):
        raise SystemExit("run: set MILES_TEST_MODEL_DIR (the checkpoints made by the assets step)")
    out.mkdir(parents=True, exist_ok=True)
    suite = out / "suite.json"
    suite.write_text(json.dumps(suite_entries(scale), indent=1))
    cluster = LocalRayCluster(nodes=1, cpus_per_node=cpus, gpus_per_node=1).start()
    try:
        cmd = [sys.executable, str(REPO / "ci" / "run_suite.py"), "--suite-json", str(suite),
               "--ray-address", cluster.gcs_address, "--gpu-shares", str(SHARES),
               "--gpu-memory-gib", f"{device_gib(scale):.1f}", "--out", str(out),
               "--plan-json", str(out / "plan.json"),
               # the cluster's daemons start from a scrubbed environment (no MILES_*): the cases
               # must still find the checkpoints made ahead
               "--case-env", "MILES_TEST_MODEL_DIR"]
        print("$", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=REPO).returncode
    finally:
        _, survivors = cluster.stop()
        if survivors:
            print("CI cluster processes survived:\n" + "\n".join(survivors), file=sys.stderr)


# -- the table -------------------------------------------------------------------------------

HEADER = ("case", "outcome", "parity max diff", "pairs/s", "peak GPU memory", "wall time")


def table_rows(results: Path, names: list[str]) -> tuple[list[tuple[str, ...]], bool]:
    rows, failed = [], False
    for name in names:
        path = results / f"{name}.json"
        record = json.loads(path.read_text()) if path.is_file() else {"outcome": "not run"}
        failed |= record.get("outcome") != "passed"
        thr = (record.get("throughput") or {}).get("mean")
        mem = record.get("peak_memory")
        parity = record.get("parity_max_diff")  # the harness fails a run whose parity is not 0.0
        rows.append((name, str(record.get("outcome")), "-" if parity is None else repr(parity),
                     f"{thr:.2f}" if thr else "-", f"{mem / 2**30:.2f} GiB" if mem else "-",
                     f"{record.get('wall_time', 0):.0f} s"))
    return rows, failed


def table(out: Path, scale: str) -> int:
    rows, failed = table_rows(out / "results", case_names(scale))
    # on the CPU the harness's peak memory is the host's
    header = HEADER if scale == "gpu" else HEADER[:4] + ("peak memory",) + HEADER[5:]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    walls = [json.loads(p.read_text()).get("wall_time") or 0.0 for p in (out / "results").glob("*.json")]
    print(f"the cases' wall times add up to {sum(walls):.0f} s (they ran at the same time)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    for step in ("assets", "suite", "run", "table"):
        s = sub.add_parser(step)
        s.add_argument("--scale", choices=("gpu", "cpu"), default="gpu",
                       help="gpu: the GPU cases; cpu: the CPU rehearsal's (the same recipes at their CPU shapes)")
        if step == "suite":
            s.add_argument("path", type=Path)
        if step in ("run", "table"):
            s.add_argument("--out", type=Path, required=True)
        if step == "run":
            s.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if args.step == "assets":
        model_dir = os.environ.get("MILES_TEST_MODEL_DIR")
        if not model_dir:
            p.error("assets: set MILES_TEST_MODEL_DIR (the harness's checkpoint cache) first")
        return assets(args.scale, Path(model_dir))
    if args.step == "suite":
        args.path.write_text(json.dumps(suite_entries(args.scale), indent=1))
        return 0
    if args.step == "run":
        return run_suite(args.scale, args.out.resolve(), args.cpus)
    return table(args.out, args.scale)


if __name__ == "__main__":
    sys.exit(main())
