"""What a run records in its run directory: metrics.jsonl, perf.jsonl, run.json, plots, wandb.

Deterministic keys: everything in metrics.jsonl except `perf/*` (wall-clock times, throughput and
peak memory). `perf/*` keys are always written to perf.jsonl as well; under --deterministic-mode
they are written *only* there, so two identical deterministic runs give byte-identical
metrics.jsonl files.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

PERF_PREFIX = "perf/"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _json_value(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # json has no NaN; keep it visible rather than crash
    return v


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, deterministic: bool, start_rollout_id: int = 0, wandb_run=None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.deterministic = deterministic
        self.wandb_run = wandb_run
        # a resumed run rewrites what followed its checkpoint, so the file matches an uninterrupted run
        for name in ("metrics.jsonl", "perf.jsonl"):
            _truncate_from(self.run_dir / name, start_rollout_id)

    def log(self, rollout_id: int, metrics: dict) -> None:
        clean = {k: _json_value(v) for k, v in sorted(metrics.items())}
        perf = {k: v for k, v in clean.items() if k.startswith(PERF_PREFIX)}
        main = {k: v for k, v in clean.items() if not (self.deterministic and k.startswith(PERF_PREFIX))}
        _append(self.run_dir / "metrics.jsonl", {"rollout_id": rollout_id, **main})
        _append(self.run_dir / "perf.jsonl", {"rollout_id": rollout_id, **perf})
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=rollout_id)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _truncate_from(path: Path, rollout_id: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["rollout_id"] < rollout_id]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def init_wandb(args):
    """A wandb run mirroring the metrics, or None. The key comes from WANDB_API_KEY only."""
    if not args.use_wandb:
        return None
    import wandb

    return wandb.init(
        project=args.wandb_project or "miles-diffusion",
        group=args.wandb_group,
        name=args.wandb_run_name,
        mode=args.wandb_mode or "online",
        dir=args.wandb_dir or str(Path(args.run_dir)),
        config={k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None), list))},
    )


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _gpu_info() -> tuple[str | None, list[str]]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(pynvml.nvmlDeviceGetCount())]
            decode = lambda s: s.decode() if isinstance(s, bytes) else s  # noqa: E731
            return decode(driver), [decode(n) for n in names]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: a CPU machine
        return None, []


def write_run_json(run_dir: str | Path, argv: list[str], *, resumed: bool, start_rollout_id: int) -> dict:
    import torch

    driver, gpu_names = _gpu_info()
    record = {
        "argv": list(argv),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "driver": driver},
        "gpu_names": gpu_names,
        "git_commit": _git_commit(),
        "resumed": resumed,
        "start_rollout_id": start_rollout_id,
        "hostname": socket.gethostname(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = Path(run_dir) / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return record


class Progress:
    """One line per rollout: id, reward, loss, parity diff, time, ETA."""

    def __init__(self, start_rollout_id: int, end_rollout_id: int):
        self.start, self.end = start_rollout_id, end_rollout_id
        self.t0 = time.monotonic()

    def line(self, rollout_id: int, metrics: dict, rollout_seconds: float) -> str:
        done = rollout_id - self.start + 1
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.end - rollout_id - 1)
        fmt = lambda k: "-" if metrics.get(k) is None else f"{float(metrics[k]):.4g}"  # noqa: E731
        return (f"[rollout {rollout_id + 1}/{self.end}] reward={fmt('rollout/reward/raw_mean')} "
                f"loss={fmt('train/loss')} parity_diff={fmt('train/model_output_max_abs_diff')} "
                f"time={rollout_seconds:.1f}s eta={eta:.0f}s")


def plot_curves(run_dir: str | Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").exists() else []
    if not records:
        return None
    panels = [("rollout/reward/raw_mean", "reward"), ("train/loss", "loss"),
              ("train/grad_norm", "grad norm"), ("train/model_output_max_abs_diff", "parity max |diff|")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    for ax, (key, title) in zip(axes, panels):
        points = [(r["rollout_id"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), marker=".")
        ax.set_title(title)
        ax.set_xlabel("rollout")
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def save_image_grid(images: list, path: str | Path, columns: int | None = None) -> Path | None:
    """Images as [3, H, W] (or video [F, 3, H, W]: its first frame) floats in [0, 1]."""
    if not images:
        return None
    import numpy as np
    from PIL import Image

    frames = [(img[0] if img.ndim == 4 else img).float().clamp(0, 1) for img in images]
    columns = columns or math.ceil(math.sqrt(len(frames)))
    rows = math.ceil(len(frames) / columns)
    h, w = frames[0].shape[1:]
    grid = np.zeros((rows * h, columns * w, 3), dtype=np.uint8)
    for i, f in enumerate(frames):
        r, c = divmod(i, columns)
        grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = (f.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    Image.fromarray(grid).save(path)
    return Path(path)


def log(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)
