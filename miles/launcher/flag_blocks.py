"""The parts of a recipe's flag blocks that every recipe writes the same way; each returns
train_diffusion.py flags as text ending in a space, ready to concatenate into a block.

What makes a recipe that recipe (its sampler, loss, learning rate, LoRA, layout) stays in its
execute(); these carry the plumbing around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from miles.launcher.config import ExecuteTrainConfig
from miles.launcher.recipe_options import RolloutScale, Scale

def run_dir(config: ExecuteTrainConfig) -> Path:
    """`<output-dir>/<run-id>`, where the launcher runs the job."""
    return Path(config.output_dir).resolve() / config.run_id


def ckpt_args(family: str, checkpoint: str, config: ExecuteTrainConfig, save_interval: Optional[int]) -> str:
    """The checkpoint trained from, and (every save_interval rollouts) the run's own checkpoints."""
    words = f"--hf-checkpoint {checkpoint} --diffusion-model-family {family} "
    if save_interval:
        words += f"--save {run_dir(config) / 'checkpoints'} --save-interval {save_interval} "
    return words


def prompt_batch_args(
    prompt_data: str, num_rollout: int, batch_size: int, samples_per_prompt: int, *,
    metadata: bool = False, rollout_seed: Optional[int] = None,
) -> str:
    """The prompt file, shuffled, and the batch: prompts per rollout x samples per prompt."""
    metadata_key = "--metadata-key metadata " if metadata else ""
    seed = f"--rollout-seed {rollout_seed} " if rollout_seed is not None else ""
    return (
        f"--prompt-data {prompt_data} --input-key prompt {metadata_key}--rollout-shuffle --num-rollout {num_rollout} "
        f"{seed}--rollout-batch-size {batch_size} --n-samples-per-prompt {samples_per_prompt} "
    )


def rollout_batch_args(prompt_data: str, scale: RolloutScale, num_rollout: Optional[int], **kwargs) -> str:
    """prompt_batch_args with the scale's batch; an unset --num-rollout means the scale's own number."""
    return prompt_batch_args(prompt_data, scale.num_rollout_or_default(num_rollout), scale.rollout_batch_size,
                             scale.n_samples_per_prompt, **kwargs)


def eval_args(eval_prompt_data: str, eval_interval: Optional[int], num_prompts: Optional[int] = None,
              before_train: bool = True) -> str:
    """Eval on the eval prompts (the first num_prompts; None: all) every eval_interval rollouts, and
    of the initial weights unless before_train is False; "" when the scale does not evaluate."""
    if not eval_interval:
        return ""
    prompts = f"--eval-num-prompts {num_prompts} " if num_prompts else ""
    skip = "" if before_train else "--skip-eval-before-train "
    return f"--eval-interval {eval_interval} --eval-prompt-data {eval_prompt_data} {prompts}{skip}"


def flow_grpo_args(clip_range: str = "1e-4", steps_per_rollout: int = 2) -> str:
    """Flow-GRPO's policy loss: group-normalised advantages, PPO clip, optimizer steps per rollout."""
    return (
        f"--loss-type policy_loss --advantage-estimator grpo --diffusion-clip-range {clip_range} "
        f"--diffusion-adv-clip-max 5.0 --num-steps-per-rollout {steps_per_rollout} "
    )


def optimizer_args(lr: str | float, weight_decay: str = "1e-4", schedule: str = "") -> str:
    """AdamW with the recipes' betas and gradient clip; `schedule` flags follow the learning rate."""
    return f"--lr {lr} {schedule}--adam-beta1 0.9 --adam-beta2 0.999 --weight-decay {weight_decay} --clip-grad 1.0 "


def cpu_reward_args(rm_type: str, num_workers: int) -> str:
    """A reward computed by CPU actors (no GPU share)."""
    return f"--rm-type {rm_type} --rm-num-workers {num_workers} --rm-num-gpus-per-worker 0 "


def pickscore_args(pickscore: str, scale: RolloutScale) -> str:
    """PickScore workers sharing the scale's reward GPUs; with colocate_reward, beside the engines."""
    return (
        f"--rm-type pickscore --pickscore-model-path {pickscore} "
        f"--rm-num-workers {scale.rm_num_workers} --rm-num-gpus-per-worker {scale.reward_gpus_per_worker:g} "
        + ("--colocate-reward " if scale.colocate_reward else "")
    )


def engine_args(num_gpus: int) -> str:
    """One rollout engine per GPU (per CPU slot on cpu)."""
    return f"--rollout-num-gpus {num_gpus} --rollout-num-gpus-per-engine 1 "


def train_backend_args(dtype: str, update_weights: str = "transformer", rollout: bool = True,
                       sharded: bool = False) -> str:
    """float32 trained weights, `dtype` forwards (and rollouts); the modules synced to the engines.
    `sharded`: FSDP2 over the train ranks, and with rollout engines both sides offloaded between
    their phases (a colocated rank and engine take turns on the GPU)."""
    words = f"--param-dtype float32 --compute-dtype {dtype} "
    if rollout:
        words += f"--rollout-dtype {dtype} "
    if update_weights:
        words += f"--update-weight-target-module {update_weights} "
    if sharded:
        words += "--train-backend fsdp " + ("--offload-train --offload-rollout " if rollout else "")
    return words


def tile_args(samples: int) -> str:
    """A 2D micro-batch tile of `samples` samples x 1 timestep, visited sample-major."""
    return (
        f"--micro-batch-size-sample {samples} --micro-batch-size-tstep 1 "
        "--diffusion-train-iter-order sample-major --train-dp-split-mode contiguous "
    )


def flat_micro_batch_args(pairs: int) -> str:
    """A flat micro-batch of `pairs` consecutive train pairs per forward."""
    return f"--micro-batch-size {pairs} --train-dp-split-mode contiguous "


def gradient_checkpointing_args(scale) -> str:
    """On where the scale says (GPUs and their CPU rehearsal); a device word: on for cuda."""
    on = scale == "cuda" if isinstance(scale, str) else scale.gradient_checkpointing
    return "--gradient-checkpointing " if on else ""


def gpu_memory_args(device: str, gpu_memory_gb: Optional[int]) -> str:
    """--gpu-memory-gb for a GPU run (refused with --device cpu, which has no GPU budget); None: no budget."""
    return f"--gpu-memory-gb {gpu_memory_gb} " if device == "cuda" and gpu_memory_gb is not None else ""


def gpu_layout_args(
    device: str, gpu_memory_gb: Optional[int], train_gpus: int, gpus_per_node: int, *,
    train_nodes: int = 1, job_nodes: Optional[int] = None,
) -> str:
    """The device and its memory budget, the train ranks (nodes x GPUs) and the GPUs of each node."""
    job_nodes_args = f"--num-nodes {job_nodes} " if job_nodes is not None else ""
    return (
        f"--device {device} " + gpu_memory_args(device, gpu_memory_gb)
        + f"--actor-num-nodes {train_nodes} --actor-num-gpus-per-node {train_gpus} "
        + f"{job_nodes_args}--num-gpus-per-node {gpus_per_node} "
    )


def deterministic_args(deterministic: bool) -> str:
    return "--deterministic-mode " if deterministic else ""


def colocated_misc_args(scale: Scale, gpu_memory_gb: Optional[int], train_gpus: int, gpus_per_node: int,
                        **nodes: int) -> str:
    """misc_args of a recipe whose train ranks and rollout engines share GPUs (--colocate): the GPU
    layout, train/rollout parity logged (--diffusion-debug-mode: exactly 0.0 when healthy), and
    --deterministic-mode where the scale asks for it. `nodes`: train_nodes / job_nodes."""
    return (
        gpu_layout_args(scale.device, gpu_memory_gb, train_gpus, gpus_per_node, **nodes)
        + "--colocate --diffusion-debug-mode " + deterministic_args(scale.deterministic)
    )
