"""What every scaled recipe shares in its `_SCALES` table and its ScriptArgs: the base of a
`_Scale` row and the options that pick the row, say where assets live and how many rollouts to train.

A recipe's `_Scale` inherits `U.Scale` (`U.RolloutScale` for recipes with rollout engines and a
reward, `U.ColocatedScale` when each train rank shares its GPU with an engine) and adds only the
fields of its own; rows are written with keywords. Its ScriptArgs inherits `U.ScaledRecipeArgs`
and states only its scales and the options of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from miles.launcher.config import REPO_ROOT, ExecuteTrainConfig

MODEL_DIR_HELP = "Released checkpoints are read from here; ours are created here once and reused."
DATA_DIR_HELP = "Where the prompt files are written."
SCALE_HELP = "Which row of the recipe's _SCALES table to run."


@dataclass(frozen=True)
class ScaleKind:
    """Whose checkpoint a scale trains, on which device and dtype, and whether bit-reproducibly."""

    checkpoint_size: Optional[str]  # None: the released checkpoint (and PickScore); "proxy" / "tiny": ours
    device: str  # "cpu": CPU slots stand in for the GPUs
    dtype: str  # train and rollout forwards; the trained weights stay float32
    deterministic: bool
    # the GPU configuration on CPU slots (issue 39): everything the GPU case sets but the device
    rehearsal: bool = False


FULL_SCALE = ScaleKind(None, "cuda", "bfloat16", deterministic=False)  # the released models, as published
GPU_PROXY = ScaleKind("proxy", "cuda", "bfloat16", deterministic=True)  # our proxy-size models, on GPUs
CPU_PROXY = ScaleKind("tiny", "cpu", "float32", deterministic=True)  # our tiny models, on CPU slots
# our tiny models on CPU slots with the GPU's dtypes and gradient checkpointing (--scale cpu-rehearsal)
CPU_REHEARSAL = ScaleKind("tiny", "cpu", "bfloat16", deterministic=True, rehearsal=True)


@dataclass(frozen=True, kw_only=True)
class Scale:
    """What --scale changes; the flag blocks in execute() are the same at every scale."""

    kind: ScaleKind = field(kw_only=False)
    num_rollout: int  # what an unset --num-rollout means
    save_interval: Optional[int] = None  # None: no checkpoints
    # FSDP2 over the train ranks (and, beside rollout engines, both sides offloaded between their
    # phases): what lets a model whose whole copy per rank would not fit its GPUs train at all
    sharded: bool = False

    @property
    def checkpoint_size(self) -> Optional[str]:
        return self.kind.checkpoint_size

    @property
    def device(self) -> str:
        return self.kind.device

    @property
    def dtype(self) -> str:
        return self.kind.dtype

    @property
    def deterministic(self) -> bool:
        return self.kind.deterministic

    @property
    def gradient_checkpointing(self) -> bool:
        """On GPUs (memory) and in their rehearsal (the same forward as the GPU's)."""
        return self.device == "cuda" or self.kind.rehearsal

    def num_rollout_or_default(self, chosen: Optional[int]) -> int:
        """--num-rollout when given, else this scale's own number."""
        return self.num_rollout if chosen is None else chosen

    def ray_gpus(self, gpus: int) -> int:
        """GPUs the Ray head offers: none on cpu, where CPU slots stand in for them."""
        return 0 if self.device == "cpu" else gpus


@dataclass(frozen=True, kw_only=True)
class RolloutScale(Scale):
    """A scale of a recipe that samples with rollout engines and scores with reward workers."""

    num_steps: int  # denoising steps
    rollout_batch_size: int  # prompts per rollout
    n_samples_per_prompt: int
    rm_num_workers: int
    num_prompts: int  # size of the generated prompt file
    eval_interval: Optional[int] = None  # None: no eval
    # prompts of the held-out set each eval samples (None: all of them). The eval samples one video
    # or image per prompt with the rollout engines; miles-diffusion's own recipes evaluate every 30
    # or 100 rollouts, and the plan prints what an eval of this size costs
    eval_prompts: Optional[int] = None
    eval_before_train: bool = False  # also evaluate the initial weights (miles-diffusion's recipes skip it)
    # GPUs the reward workers share equally: GPUs of their own, or with colocate_reward a share of the
    # train GPUs beside the engines; 0: the workers are CPU actors
    reward_gpus: float = 0
    colocate_reward: bool = False

    @property
    def reward_gpus_per_worker(self) -> float:
        return self.reward_gpus / self.rm_num_workers

    @property
    def separate_reward_gpus(self) -> int:
        """GPUs the reward takes beyond the train GPUs."""
        return 0 if self.colocate_reward else int(self.reward_gpus)


@dataclass(frozen=True, kw_only=True)
class ColocatedScale(RolloutScale):
    """A scale of a one-node recipe whose train ranks each share a GPU with a rollout engine."""

    train_ranks: int  # GPUs (CPU slots on cpu), each holding a train rank and a rollout engine


def rehearsal_scale(cpu_row: Scale, gpu_row: Scale, **changes: Any) -> Scale:
    """`--scale cpu-rehearsal`: the CPU proxy's sizes with every setting of the GPU case `gpu_row` but
    the device: its dtypes (bfloat16 over float32 masters), gradient checkpointing, its train backend
    (FSDP2 and offload where it shards); `changes` for a row that rehearses another GPU scale's backend.
    The micro-batch tile stays the CPU proxy's: a GPU tile needs that many samples per optimizer step
    and rank, 2-4x the proxy's samples (tests/e2e/test_dry_rehearsal.py lists where the two differ)."""
    return dataclasses.replace(cpu_row, kind=CPU_REHEARSAL, sharded=gpu_row.sharded, **changes)


def scale_option(help: str = SCALE_HELP) -> Any:
    """`--scale`, `full` unless chosen; the recipe annotates it with a Literal of its scales."""
    return field(default="full", metadata={"help": help})


def model_dir_option(help: str = MODEL_DIR_HELP) -> Any:
    return field(default=str(REPO_ROOT / "models"), metadata={"help": help})


def data_dir_option(help: str = DATA_DIR_HELP) -> Any:
    return field(default=str(REPO_ROOT / "data"), metadata={"help": help})


def num_rollout_option(scales: Mapping[str, Scale], what: str = "Rollouts to train") -> Any:
    """`--num-rollout`, unset by default: each scale then trains its own number, listed in the help."""
    return field(default=None, metadata={"help": f"{what}; unset: {_defaults_by_scale(scales)}."})


def _defaults_by_scale(scales: Mapping[str, Scale]) -> str:
    """`300 (full), 4 (gpu-proxy), 2 (1gpu-proxy, cpu-proxy)`: scales with the same number together."""
    names_by_count: dict[int, list[str]] = {}
    for name, scale in scales.items():
        names_by_count.setdefault(scale.num_rollout, []).append(name)
    return ", ".join(f"{count} ({', '.join(names)})" for count, names in names_by_count.items())


@dataclass
class ScaledRecipeArgs(ExecuteTrainConfig):
    """The options of a recipe with a `_SCALES` table, in the order --help lists them. The recipe
    narrows --scale to its own scales, `scale: Literal[...] = U.scale_option("full: ...")`, and
    gives --num-rollout its table's defaults, `U.num_rollout_option(_SCALES)`; a redeclared field
    keeps its place here. --model-dir and --data-dir it inherits as they are."""

    scale: str = scale_option()
    num_rollout: Optional[int] = field(default=None, metadata={"help": "Rollouts to train; unset: the scale's own."})
    model_dir: str = model_dir_option()
    data_dir: str = data_dir_option()
