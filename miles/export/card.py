"""The model card (`README.md`) of an export: where the weights came from and how to load them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from miles.export.source import CheckpointSource

# flags that say where things go or how a run is watched, not what it learns
NOT_TRAINING = {"run_dir", "save", "save_interval", "load", "use_wandb", "wandb_project", "wandb_group",
                "wandb_run_name", "wandb_mode", "wandb_dir", "validate_only", "custom_config_path", "num_nodes",
                "gpu_memory_gb", "host_memory_gb", "debug_fault", "max_restarts", "eval_interval", "eval_prompt_data",
                "eval_num_prompts", "diffusion_debug_mode", "actor_num_nodes", "actor_num_gpus_per_node",
                "rollout_num_gpus", "rollout_num_gpus_per_engine", "num_gpus_per_node", "colocate", "colocate_reward",
                "rm_num_workers", "rm_num_gpus_per_worker", "reward_timeout", "weight_sync", "update_weight_buffer_size",
                "offload_train", "offload_rollout"}


def base_revision(base: Path) -> str:
    """The Hub revision of a base in the HF cache layout (`.../snapshots/<sha>`), else a digest of
    its configs (small files: a local checkpoint is named by what it is built from)."""
    if base.resolve().parent.name == "snapshots":
        return base.resolve().name
    digest = hashlib.sha256()
    for path in sorted(base.rglob("*.json")):
        digest.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes())
    return f"local, configs sha256:{digest.hexdigest()[:16]}"


def training_flags(source: CheckpointSource) -> dict[str, object]:
    """The run's flags whose values differ from train_diffusion.py's defaults, paths aside."""
    from miles.flags.arguments import build_parser

    defaults = vars(build_parser().parse_known_args(["--hf-checkpoint", "x"])[0])
    chosen = vars(source.train_args)
    return {k: v for k, v in sorted(chosen.items())
            if k not in NOT_TRAINING and k != "hf_checkpoint" and defaults.get(k) != v}


def final_metrics(run_dir: Path, rollout_id: int) -> dict[str, object]:
    """The exported rollout's row of the run's metrics.jsonl (empty if the run logged none)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    row = next((r for r in reversed(rows) if r.get("rollout_id") == rollout_id), {})
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


def recipe_of(run_dir: Path) -> str:
    plan = run_dir / "plan.json"
    if plan.exists():
        return json.loads(plan.read_text()).get("recipe", "train_diffusion.py")
    return "train_diffusion.py (no plan.json: launched without a recipe)"


def model_card(source: CheckpointSource, kind: str, files: list[str], how_to_load: str) -> str:
    flags = training_flags(source)
    metrics = final_metrics(source.run_dir, source.rollout_id)
    lines = [
        "---", "library_name: diffusers", f"base_model: {source.base}", "tags: [miles-diffusion, "
        f"{'lora' if source.lora else 'full-finetune'}, {source.family}]", "---", "",
        f"# {source.family} {'LoRA' if source.lora else 'fine-tune'} from {source.run_dir.name}, "
        f"rollout {source.rollout_id}",
        "",
        f"- recipe: `{recipe_of(source.run_dir)}`",
        f"- base checkpoint: `{source.base}` (revision: {base_revision(source.base)})",
        f"- checkpoint: `{source.checkpoint}` (rollout {source.rollout_id}, train backend {source.backend})",
        f"- weights: {'EMA shadow' if kind == 'ema' else 'trained'}"
        + (f"; LoRA rank {source.lora.rank}, alpha {source.lora.alpha}, targets {', '.join(source.lora.target_modules)}"
           if source.lora else ""),
        f"- files: {', '.join(files)}",
        "", "## How to load", "", "```python", how_to_load.strip(), "```",
        "", "## Flags that changed training", "",
    ]
    lines += [f"- `--{k.replace('_', '-')}` = `{v}`" for k, v in flags.items()] or ["(all defaults)"]
    lines += ["", f"## Metrics at rollout {source.rollout_id}", ""]
    lines += [f"- `{k}`: {v}" for k, v in metrics.items()] or ["(the run's metrics.jsonl has no row for it)"]
    lines += ["", f"Full training command (train_diffusion.py argv): `{' '.join(source.train_argv)}`", ""]
    return "\n".join(lines)
