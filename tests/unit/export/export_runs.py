"""Trained runs for the export tests, made in process: a tiny checkpoint's transformer(s) with
LoRA attached (or all weights trained), moved off their start by a seeded step, saved by the
trainer's own `TrainRank.save` into a committed checkpoint inside a run dir with its run.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

LORA_RANK, LORA_ALPHA = 4, 8  # alpha != rank: an adapter loaded with diffusers' default alpha would differ


def train_argv(base: Path, family: str, run_dir: Path, lora: bool, ema: bool, backend: str = "dp") -> list[str]:
    argv = ["--hf-checkpoint", str(base), "--diffusion-model-family", family, "--save", str(run_dir / "checkpoints"),
            "--run-dir", str(run_dir), "--lr", "1e-3", "--train-backend", backend]
    if lora:
        argv += ["--use-lora", "--lora-rank", str(LORA_RANK), "--lora-alpha", str(LORA_ALPHA)]
    if ema:
        argv += ["--use-ema", "--ema-decay", "0.5"]
    return argv


def trained_rank(base: Path, argv: list[str], seed: int = 0, scale: float = 0.05):
    """A TrainRank holding the run's model with its trained weights moved by `scale` x N(0, 1)
    (seeded), and its EMA halfway between; no process group, no Ray."""
    from miles.backends.actor import TrainRank
    from miles.backends.ema import EMA
    from miles.backends.lora import attach_lora, lora_spec_from_args
    from miles.models.loader import load_model
    from miles.flags.arguments import build_parser

    args = build_parser().parse_known_args(argv)[0]
    rank = TrainRank.__new__(TrainRank)
    rank.args, rank.rank, rank.world_size, rank.offload, rank.optimizer_step = args, 0, 1, None, 0
    rank.model = load_model(base, family=args.diffusion_model_family)
    rank.components = list(rank.model.spec.transformer_components)
    rank.lora = lora_spec_from_args(args, rank.model.spec)
    torch.manual_seed(seed)  # LoRA's A starts random: seeded as TrainRank.setup seeds it, the same in every process
    for component in rank.components:
        module = rank.model.transformers[component]
        attach_lora(module, rank.lora) if rank.lora else module.requires_grad_(True)
    rank.params = rank._trained_params()
    generator = torch.Generator().manual_seed(seed)
    rank.ema = None
    for step in range(2 if args.use_ema else 1):  # with EMA: its shadow stays between the two steps
        if step == 1:
            rank.ema = EMA(rank.params, 0.5)
        with torch.no_grad():
            for p in rank.params.values():
                p.add_(scale * torch.randn(p.shape, generator=generator))
    if rank.ema is not None:
        rank.ema.update(rank.params)
    rank.optimizer = torch.optim.AdamW(list(rank.params.values()), lr=1e-3)
    return rank


def write_run_records(run_dir: Path, argv: list[str], rollout_id: int) -> None:
    (run_dir / "run.json").write_text(json.dumps({"argv": argv, "resumed": False, "start_rollout_id": 0}))
    rows = [{"rollout_id": i, "rollout/reward/raw_mean": 0.25 + 0.125 * i, "perf/rollout_time": 1.0}
            for i in range(rollout_id + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_run(run_dir: Path, base: Path, family: str, *, lora: bool, ema: bool = False, rollout_id: int = 2,
             extra: tuple[str, ...] = ()):
    """A run dir with run.json, metrics.jsonl and one committed checkpoint; returns (run dir, rank)."""
    argv = train_argv(base, family, run_dir, lora, ema) + list(extra)
    run_dir.mkdir(parents=True)
    write_run_records(run_dir, argv, rollout_id)
    rank = trained_rank(base, argv)
    commit(rank, run_dir / "checkpoints", rollout_id)
    return run_dir, rank


def commit(rank, root: Path, rollout_id: int) -> Path:
    from miles.backends import checkpoint as ckpt

    root.mkdir(parents=True, exist_ok=True)
    staging = ckpt.staging_dir(root, rollout_id)
    rank.save(str(staging))
    (staging / "trainer.json").write_text(json.dumps({"rollout_id": rollout_id}) + "\n")
    return ckpt.commit(staging, root, rollout_id)


def fsdp_ranks(rank_id: int, port: int, base: str, runs: list[tuple[str, bool]]) -> None:
    """One of 2 spawned ranks; for each (run dir, lora): the same trained weights as `trained_rank`
    gives the dp run (same seed), sharded with the trainer's FSDP2 units, EMA included, saved by
    TrainRank.save's fsdp path into <run dir>/checkpoints/rollout_000002."""
    import torch.distributed as dist

    from miles.models.runtime import configure_torch

    configure_torch(num_threads=1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_id, world_size=2)
    for run_dir, lora in runs:
        _save_sharded_run(rank_id, Path(base), Path(run_dir), lora)
    dist.destroy_process_group()


def _save_sharded_run(rank_id: int, base: Path, run_dir: Path, lora: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from miles.backends import checkpoint as ckpt
    from miles.backends import fsdp
    from miles.backends.ema import EMA

    rank = trained_rank(base, train_argv(base, "sd3", run_dir, lora, ema=True, backend="fsdp"))
    rank.rank, rank.world_size = rank_id, 2
    shadow = rank.ema.shadow
    fsdp.shard_model(rank.model, rank.components, fsdp.device_mesh(torch.device("cpu"), 2), torch.float32,
                     torch.float32)
    rank.params = rank._trained_params()
    rank.ema = EMA(rank.params, 0.5)
    for name, p in rank.params.items():
        rank.ema.shadow[name] = distribute_tensor(shadow[name], p.device_mesh, p.placements)
    rank.optimizer = torch.optim.AdamW(list(rank.params.values()), lr=1e-3)
    root = run_dir / "checkpoints"
    staging = root / ".staging_rollout_000002"
    if rank_id == 0:
        root.mkdir(parents=True)
        staging = ckpt.staging_dir(root, 2)
    dist.barrier()
    rank.save(str(staging))
    dist.barrier()
    if rank_id == 0:
        (staging / "trainer.json").write_text(json.dumps({"rollout_id": 2}) + "\n")
        ckpt.commit(staging, root, 2)
    dist.barrier()


def export(*argv) -> int:
    from miles.export.cli import main

    return main([str(a) for a in argv])
