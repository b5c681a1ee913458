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

from miles.records.hub_snapshots import hub_revisions_in_argv

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

    def log_images(self, rollout_id: int, images: list, captions: list | None, *, count: int, interval: int) -> int:
        """--wandb-log-num-images / --wandb-log-image-interval: the first `count` samples of a rollout
        every `interval` rollouts, as wandb images (a video's first frame) titled by prompt and reward.
        Returns how many were logged."""
        if self.wandb_run is None or not count or rollout_id % interval or not images:
            return 0
        import wandb

        shown = images[:count]
        titles = list(captions or [])[:len(shown)]
        titles += [None] * (len(shown) - len(titles))
        logged = [wandb.Image(frame, caption=None if title is None else
                              (title if isinstance(title, str) else sample_caption(*title)))
                  for frame, title in zip(_grid_frames(shown), titles)]
        self.wandb_run.log({"rollout/samples": logged}, step=rollout_id)
        return len(logged)

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


def init_wandb(args, resume_id: str | None = None):
    """A wandb run mirroring the metrics, or None. The key comes from WANDB_API_KEY only.

    `resume_id`: the wandb run a resumed run's checkpoint recorded; that run is continued (same id)
    instead of a new one being opened.

    wandb's own conventions hold: WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY and WANDB_DIR from the
    environment apply unless a flag was given. A wandb that cannot start (offline machine, bad key)
    costs one warning line and the run goes on with local metrics; with --wandb-required the run
    stops before training with one line instead."""
    if not args.use_wandb:
        return None
    import os
    import sys

    mode = getattr(args, "wandb_mode", None) or os.environ.get("WANDB_MODE") or "online"
    try:
        import wandb

        return wandb.init(
            project=args.wandb_project or os.environ.get("WANDB_PROJECT") or "miles-diffusion",
            entity=getattr(args, "wandb_entity", None) or os.environ.get("WANDB_ENTITY") or None,
            group=args.wandb_group,
            name=args.wandb_run_name,
            mode=mode,
            dir=args.wandb_dir or os.environ.get("WANDB_DIR") or str(Path(args.run_dir)),
            config={k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None), list))},
            settings=wandb.Settings(init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", "30"))),
            **({"id": resume_id, "resume": "allow"} if resume_id else {}),
        )
    except Exception as err:  # wandb raises its own types (CommError, UsageError, AuthenticationError...)
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if getattr(args, "wandb_required", False):
            raise RuntimeError(f"wandb could not start (mode {mode}): {reason}; fix: check WANDB_API_KEY and the "
                               f"network, or drop --wandb-required") from None
        print(f"WARNING: wandb could not start (mode {mode}): {type(err).__name__}: {reason}; training goes on, "
              f"metrics are written to {args.run_dir}/metrics.jsonl", file=sys.stderr, flush=True)
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def visible_gpu_entries(cuda_visible_devices: str | None, count: int) -> list[str]:
    """The machine's GPUs a process was given, as NVML indices ("0") or UUID prefixes ("GPU-8f..").

    CUDA_VISIBLE_DEVICES unset: all `count`; set: its entries up to the first invalid one (CUDA
    ignores the rest); empty or "-1": none. The launcher hands a run its leased GPUs this way, and
    Ray's raylet and every zero-GPU worker (the job driver) inherit it.
    """
    if cuda_visible_devices is None:
        return [str(i) for i in range(count)]
    entries = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit() and int(entry) < count:
            entries.append(entry)
        elif entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break
    return entries


def _gpu_info(device: str = "cuda", environ=None) -> tuple[str | None, list[str]]:
    """(driver version, names of the GPUs this run was given): none for a --device cpu run."""
    environ = os.environ if environ is None else environ
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            decode = lambda s: s.decode() if isinstance(s, bytes) else s  # noqa: E731
            driver = decode(pynvml.nvmlSystemGetDriverVersion())
            if device != "cuda":
                return driver, []
            names = []
            for entry in visible_gpu_entries(environ.get("CUDA_VISIBLE_DEVICES"), pynvml.nvmlDeviceGetCount()):
                if entry.isdigit():
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
                elif entry.startswith("MIG-"):
                    handle = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
                        pynvml.nvmlDeviceGetHandleByUUID(entry))
                else:
                    handle = _handle_by_uuid_prefix(pynvml, entry)
                names.append(decode(pynvml.nvmlDeviceGetName(handle)))
            return driver, names
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: a CPU machine
        return None, []


def _handle_by_uuid_prefix(pynvml, prefix: str):
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(prefix):
            return handle
    raise LookupError(f"no GPU with UUID {prefix}")


def write_run_json(run_dir: str | Path, argv: list[str], *, resumed: bool, start_rollout_id: int,
                   device: str = "cuda", extra: dict | None = None) -> dict:
    import torch

    from miles.utils import numerics

    driver, gpu_names = _gpu_info(device)  # the GPUs the run was given, not every GPU of the machine
    record = {
        "argv": list(argv),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda, "driver": driver},
        "gpu_names": gpu_names,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES") if device == "cuda" else None,
        "git_commit": _git_commit(),
        "hub_revisions": hub_revisions_in_argv(list(argv)),  # the Hub commits of cached models it was given
        "resumed": resumed,
        "start_rollout_id": start_rollout_id,
        "hostname": socket.gethostname(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # what decides the run's bits, compared with a standard's (docs/testing.md), and the machine
        "fingerprint": numerics.fingerprint(gpu_names, driver, torch.version.cuda),
        "machine": numerics.machine_info(),
        **(extra or {}),  # e.g. loaded_from: the checkpoint resumed, and what --load-anyway accepted
    }
    path = Path(run_dir) / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return record


PARITY_KEYS = ("train/model_output_mean_abs_diff", "train/model_output_max_abs_diff", "train/log_prob_abs_diff")


def parity_drift(metrics: dict) -> dict:
    """The parity probe's readings that are not exactly 0.0 (empty: on-policy, or no probe)."""
    return {k: metrics[k] for k in PARITY_KEYS if isinstance(metrics.get(k), (int, float)) and metrics[k] != 0.0}


class Progress:
    """One line per rollout: id, reward, loss, parity diff (marked OFF-POLICY when not 0), time, ETA."""

    def __init__(self, start_rollout_id: int, end_rollout_id: int):
        self.start, self.end = start_rollout_id, end_rollout_id
        self.t0 = time.monotonic()

    def line(self, rollout_id: int, metrics: dict, rollout_seconds: float) -> str:
        done = rollout_id - self.start + 1
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.end - rollout_id - 1)
        fmt = lambda k: "-" if metrics.get(k) is None else f"{float(metrics[k]):.4g}"  # noqa: E731
        off = " OFF-POLICY" if parity_drift(metrics) else ""
        return (f"[rollout {rollout_id + 1}/{self.end}] reward={fmt('rollout/reward/raw_mean')} "
                f"loss={fmt('train/loss')} parity_diff={fmt('train/model_output_max_abs_diff')}{off} "
                f"time={rollout_seconds:.1f}s eta={eta:.0f}s")


# (metric key, panel title, y-axis label with its unit); the x axis of every panel is the rollout id
CURVE_PANELS = (
    ("rollout/reward/raw_mean", "reward", "rollout/reward/raw_mean (reward, mean)"),
    ("train/loss", "loss", "train/loss (policy loss)"),
    ("train/grad_norm", "grad norm", "train/grad_norm (L2, before clipping)"),
    ("train/model_output_max_abs_diff", "parity max |diff|", "train/model_output_max_abs_diff (abs)"),
)
CURVES_XLABEL = "rollout"
PARITY_CAPTION = "train/rollout parity: |train forward - rollout forward| on the same weights; must be exactly 0"
CAPTION_PROMPT_CHARS = 40


def curves_figure(records: list[dict]):
    """The curves of `records` (metrics.jsonl rows) as a matplotlib Figure: one panel per metric
    with labelled axes, and a caption saying what the parity panel measures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_PANELS), figsize=(4 * len(CURVE_PANELS), 3.4))
    for ax, (key, title, ylabel) in zip(axes, CURVE_PANELS):
        points = [(r["rollout_id"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), marker=".")
        ax.set_title(title)
        ax.set_xlabel(CURVES_XLABEL)
        ax.set_ylabel(ylabel, fontsize=8)
    fig.text(0.5, 0.01, PARITY_CAPTION, ha="center", va="bottom", fontsize=9)
    # fixed margins, not tight_layout: that draws the figure once more to measure it, a third of the
    # plot's time, and every run draws this once (the panels' text is the same every time)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.24, top=0.9, wspace=0.36)
    return fig


def plot_curves(run_dir: str | Path) -> Path | None:
    """<run_dir>/curves.png from <run_dir>/metrics.jsonl; None when there is nothing to plot."""
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").exists() else []
    if not records:
        return None
    fig = curves_figure(records)
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def sample_caption(prompt: str, reward: float | None, limit: int = CAPTION_PROMPT_CHARS) -> str:
    """`prompt` shortened to `limit` characters (an ellipsis marks a cut), then the reward."""
    text = " ".join(str(prompt).split())
    if len(text) > limit:
        text = text[:limit - 1].rstrip() + "\u2026"
    score = "-" if reward is None else f"{float(reward):.4g}"
    return f"{text}\nreward {score}"


def image_grid_figure(images: list, captions: list | None = None, columns: int | None = None):
    """Images ([3, H, W], or a video's first frame) in a grid of matplotlib axes, each titled with
    its sample's caption: `captions[i]` is a (prompt, reward) pair, or a ready string."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = _grid_frames(images)
    columns = columns or math.ceil(math.sqrt(len(frames)))
    rows = math.ceil(len(frames) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.9 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= len(frames):
            continue
        ax.imshow(frames[i], interpolation="nearest")
        if captions is not None and i < len(captions):
            caption = captions[i]
            ax.set_title(caption if isinstance(caption, str) else sample_caption(*caption), fontsize=7)
    # fixed margins (see curves_figure): each cell is a square image under a two-line caption
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.4 / (2.9 * rows), hspace=0.25, wspace=0.08)
    return fig


def _grid_frames(images: list) -> list:
    """HxWx3 uint8 arrays: a video's first frame, floats in [0, 1] clamped."""
    import numpy as np

    return [(((img[0] if img.ndim == 4 else img).float().clamp(0, 1).permute(1, 2, 0).numpy()) * 255)
            .round().astype(np.uint8) for img in images]


def save_image_grid(images: list, path: str | Path, columns: int | None = None,
                    captions: list | None = None) -> Path | None:
    """Images as [3, H, W] (or video [F, 3, H, W]: its first frame) floats in [0, 1].

    Without captions: the pixels alone, tiled. With `captions` (one per image: a (prompt, reward)
    pair, as the rollout's `last_captions`, or a string): a figure with each sample titled by its
    shortened prompt and its reward."""
    if not images:
        return None
    if captions is not None:
        import matplotlib.pyplot as plt

        fig = image_grid_figure(images, captions, columns)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return Path(path)
    import numpy as np
    from PIL import Image

    frames = _grid_frames(images)
    columns = columns or math.ceil(math.sqrt(len(frames)))
    rows = math.ceil(len(frames) / columns)
    h, w = frames[0].shape[:2]
    grid = np.zeros((rows * h, columns * w, 3), dtype=np.uint8)
    for i, f in enumerate(frames):
        r, c = divmod(i, columns)
        grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = f
    Image.fromarray(grid).save(path)
    return Path(path)


def log(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)
