"""The memory plan: per-GPU peak memory of each role, estimated before anything starts. Torch-free.

Shown beside the batch plan (`train_diffusion.py --validate-only`, the trainer's start, the
launcher's dry run and plan.json) and enforced by the launcher and the dry check: a recipe whose
estimate exceeds its GPU's budget (`--gpu-memory-gb` minus HEADROOM_FRACTION of it) is refused
with the role, the estimate, the budget and the knobs that would help.

Facts come from the checkpoint, never from its weights: on disk, each component folder's
safetensors headers (tensor shapes; a header is a few KiB at the start of the file) and
`config.json`; not on disk, the committed table of computed parameter counts
(`miles/plan/model_table.py`). A checkpoint in neither gets "estimate unavailable".

The model (what each term is, in bytes; p = --param-dtype, c = --compute-dtype, r = --rollout-dtype;
a part the family runs in float32, Wan's VAE, is in float32 wherever p, c or r would hold it):

train rank, --train-backend dp (miles/backends/actor.py; nothing is sharded, so the sharding
factor is 1 and every term is per rank whatever the rank count):
  master model      every transformer component + the VAE, in p (the loader loads them all)
  compute copy      the same again in c, when c != p (the copy forwards and the probe run on)
  trained state     per trained parameter T (the trained components, or the LoRA adapters), at
                    the optimizer step's peak: backward's gradient (in c on the copy, else in p)
                    while it is packed into the flat all-reduce buffer in p (whose views become
                    the gradients the step reads) + AdamW exp_avg and exp_avg_sq in p (+ the EMA
                    copy in p with --use-ema); LoRA adds its adapters to both models
  activations       pairs per forward x forwards per pair (2 when guided) x per-forward bytes;
                    a transformer block keeps ACT_VALUES_PER_TOKEN x tokens x hidden values in c
                    (Korthikanti et al. 2022, "Reducing Activation Recomputation", with flash
                    attention: no s^2 term); with --gradient-checkpointing only each block's input
                    (1 value) is kept, plus one block's full set during its recompute
train rank, --train-backend fsdp (miles/backends/fsdp.py; sharding factor N = the train ranks):
  master model      the trained components / N in p (FSDP2 shards them); under LoRA with a float32
                    p only the adapters are in p, the frozen base in c (sharded_load.frozen_base_to);
                    every other part (VAE, an untrained expert) whole in c (cast once; there is no
                    compute copy)
  gathered unit     one transformer block all-gathered in c, and its unsharded gradient in c
                    during backward (the largest block: component params / blocks)
  trained state     per trained parameter / N: the reduce-scattered gradient in p + AdamW
                    exp_avg and exp_avg_sq in p (+ EMA in p); LoRA adapters are sharded with the
                    model (their p bytes / N are in the master model term)
  activations       as for dp (a rank's forwards see whole weights)
offload (--offload-train / --offload-rollout, --colocate only): a train GPU's peak is the largest
  of its phases instead of the sum of its roles (a side that does not compute in a phase holds
  no activations in it). training: the rank + the engine without its pipeline weights
  (--offload-rollout); rollout: the engine + the rank without its models and optimizer state
  (--offload-train); weight sync: the engine without activations + (--offload-train) only the
  tensors the update reads (trained tensors or LoRA adapters, sharded / N) + the push's staging.
  One flag alone leaves a phase with both sides' weights resident.
weight push staging (bucketed sync): colocated, the IPC push (miles.backends.ipc_push): the engine
  stages nothing, each train rank holds one reused buffer the size of the largest bucket from the
  push path's forming on (a term of the rank, every phase); else the broadcast: one bucket on the
  sender and one on the receiver while they push.
engine (one per rollout GPU): every component of the pipeline (transformers, text encoders,
  VAE) in r, plus one forward's block activations (no graph) over its batch (the microgroup, twice
  that where the family guides in one call), plus the VAE decoder's peak (VAE_DECODE_MAPS feature
  maps of VAE_DECODE_CHANNELS channels at pixel resolution, or at 1 / decode_stride of it in each
  direction for a VAE that unpatchifies last, over one decoded chunk of each sample of the
  microgroup, decoded together), plus the trajectories it holds in fp32
reward worker: its scorer's parameters in fp32 (PickScore: a CLIP model), times the workers
  sharing a GPU
every process on a GPU: CUDA_CONTEXT_GIB for the CUDA context, cuBLAS/NCCL workspaces
per GPU: a train GPU carries its rank, plus an engine with --colocate, plus reward workers with
  --colocate-reward; a rollout GPU its engine; a reward GPU its workers.
"""

from __future__ import annotations

import math
from argparse import Namespace
from dataclasses import dataclass, field

from miles.diffusion_facts.families import get_family_facts
from miles.plan.eval_plan import eval_lines
from miles.plan.host_plan import HostPlan, HostPlanError, build_host_plan
from miles.plan.model_facts import (  # noqa: F401  (the plan's facts; model_facts and the table keys re-exported)
    CFG_IN_ONE_CALL, DTYPE_BYTES, GEOMETRY, ComponentFacts, Geometry, ModelFacts, _guided, _hub_repo_name,
    _lora_params, _table_key, _text_tokens, _tokens, _trained, held_bytes, model_facts, part_bytes, read_checkpoint,
    safetensors_params,
)

GIB = 1024 ** 3
DEFAULT_GPU_MEMORY_GB = 80.0
HEADROOM_FRACTION = 0.10  # what the model leaves out: allocator slack (the CPU validation measured 1.04-1.07 x the
# estimate, docs/memory-plan.md), a heavier CUDA build (DESIGN section 9)
CUDA_CONTEXT_GIB = 1.0
ACT_VALUES_PER_TOKEN = 17  # Korthikanti et al.: 34 s b h bytes per layer at 2 bytes a value
VAE_DECODE_MAPS = 6
VAE_DECODE_CHANNELS = 128

class MemoryPlanError(ValueError):
    """An estimate over a role's budget; the message names role, estimate, budget and fixes."""



@dataclass
class RoleEstimate:
    role: str
    terms: list[tuple[str, float]]  # (what, bytes)
    count_per_gpu: int = 1
    # the bytes offload moves to the host (train rank: models, optimizer state; engine: weights) and
    # the working set a phase without compute drops (activations)
    models: float = 0.0
    optimizer_state: float = 0.0
    activations: float = 0.0
    synced: float = 0.0  # train rank: what a weight update reads (trained tensors or LoRA adapters)
    saved: float = 0.0  # train rank: the checkpoint's tensors it holds (trained master, AdamW, EMA copies)
    trajectories: float = 0.0  # engine: the microgroup's trajectories (the code keeps them on the host)

    @property
    def total(self) -> float:
        return sum(b for _, b in self.terms) * self.count_per_gpu


@dataclass
class GpuEstimate:
    name: str  # "train GPU", "rollout GPU", "reward GPU"
    roles: list[RoleEstimate]
    knobs: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # with offload: bytes resident in each phase

    @property
    def total(self) -> float:
        return max(self.phases.values()) if self.phases else sum(r.total for r in self.roles)


@dataclass
class MemoryPlan:
    lines: list[str]
    gpus: list[GpuEstimate] = field(default_factory=list)
    budget_gib: float | None = None
    gpu_memory_gb: float | None = None
    available: bool = True
    host: HostPlan | None = None  # each node's host memory (miles.plan.host_plan)

    def table(self) -> str:
        return "\n".join(self.lines)

    def over_budget(self) -> list[GpuEstimate]:
        if self.budget_gib is None:
            return []
        return [g for g in self.gpus if g.total / GIB > self.budget_gib]

    def check(self) -> None:
        over = self.over_budget()
        if not over:
            self._check_host()
            return
        g = over[0]
        roles = " + ".join(f"{r.role} {r.total / GIB:.1f} GiB" for r in g.roles)
        raise MemoryPlanError(
            f"memory plan: each {g.name} needs an estimated {g.total / GIB:.1f} GiB ({roles}), over its budget of "
            f"{self.budget_gib:.1f} GiB (--gpu-memory-gb {self.gpu_memory_gb:g} minus {HEADROOM_FRACTION:.0%} "
            f"headroom); what would help: {'; '.join(g.knobs) or 'a GPU with more memory'}")

    def _check_host(self) -> None:
        if self.host is None:
            return
        try:
            self.host.check()
        except HostPlanError as err:
            raise MemoryPlanError(str(err)) from err


# -- GPU memory -----------------------------------------------------------------------------------

def nvml_gpu_memory_gb() -> float | None:
    """GiB of GPU 0 by NVML, or None without a driver/pynvml (never imports torch)."""
    try:
        import pynvml  # type: ignore

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / GIB
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def gpu_memory_gb(ns: Namespace) -> float:
    value = getattr(ns, "gpu_memory_gb", None)
    if value is not None:
        return float(value)
    return nvml_gpu_memory_gb() or DEFAULT_GPU_MEMORY_GB


# -- the estimate -----------------------------------------------------------------------------------


def _pairs_per_forward(ns: Namespace, plan) -> int:
    return plan.pairs_per_forward  # the flags, or the rollout tile they default to



def _sharding_factor(ns: Namespace) -> int:
    from miles.flags.validation import train_gpus

    if getattr(ns, "train_backend", "dp") != "fsdp":
        return 1
    return train_gpus(ns) // getattr(ns, "dp_replicate_size", 1)  # HSDP shards within a replica


def _train_rank(ns: Namespace, plan, facts: ModelFacts, geo: Geometry) -> tuple[RoleEstimate, list[str]]:
    if getattr(ns, "train_backend", "dp") == "fsdp":
        return _sharded_train_rank(ns, plan, facts, geo)
    p, c = DTYPE_BYTES[ns.param_dtype], DTYPE_BYTES[ns.compute_dtype]
    copy = c != p
    comps = facts.components
    transformers = [n for n in comps if n.startswith("transformer")]
    kept = transformers + [n for n in comps if n == "vae"]
    if ns.loss_type == "sft_loss":
        kept_copy = kept + [n for n in comps if n.startswith("text_encoder")]
    else:
        kept_copy = kept
    trained = _trained(ns, facts)
    model_params = sum(comps[n].params for n in kept)
    family = ns.diffusion_model_family
    if ns.use_lora:
        t_params = _lora_params(ns, facts, geo, trained)
        what = f"LoRA rank {ns.lora_rank} on {'+'.join(trained)}"
    else:
        t_params = sum(comps[n].params for n in trained)
        what = f"full {'+'.join(trained)}"
    master_note = _float32_note(family, kept, ns.param_dtype)
    terms = [(f"master model {model_params / 1e9:.2f} B params in {ns.param_dtype}{master_note}",
              held_bytes(family, comps, kept, p))]
    if copy:
        terms.append((f"compute copy in {ns.compute_dtype}{_float32_note(family, kept_copy, ns.compute_dtype)}",
                      held_bytes(family, comps, kept_copy, c)))
    if ns.use_lora:
        terms.append(("LoRA adapters on the model(s)", t_params * (p + (c if copy else 0))))
    copies = (p if ns.use_ema else 0) + (p if getattr(ns, "ema_rollout_policy", None) == "ema" else 0)
    copy_names = ", EMA" * bool(ns.use_ema) + ", NFT old policy" * (getattr(ns, "ema_rollout_policy", None) == "ema")
    per_trained = (c if copy else p) + p + 2 * p + copies
    terms.append((f"trained state {what}: {t_params / 1e9:.3f} B params x {per_trained} B "
                  f"(backward's grads, the reduced grads, AdamW{copy_names})",
                  t_params * per_trained))
    optimizer_state = t_params * (2 * p + copies)
    grads = t_params * ((c if copy else p) + p)  # gone between steps (set to None)
    models = sum(b for _, b in terms) - optimizer_state - grads
    act_term, act_bytes = _activations(ns, plan, facts, geo, trained, c)
    terms += [act_term, ("CUDA context and workspaces", CUDA_CONTEXT_GIB * GIB)]
    role = RoleEstimate("train rank", terms, models=models, optimizer_state=optimizer_state,
                        activations=act_bytes + grads, synced=t_params * (c if copy else p),
                        saved=t_params * p + optimizer_state)
    return role, _train_knobs(ns, plan, trained, copy)



def _sharded_train_rank(ns: Namespace, plan, facts: ModelFacts, geo: Geometry) -> tuple[RoleEstimate, list[str]]:
    """--train-backend fsdp: see the module docstring's model."""
    p, c = DTYPE_BYTES[ns.param_dtype], DTYPE_BYTES[ns.compute_dtype]
    n = _sharding_factor(ns)
    comps = facts.components
    trained = _trained(ns, facts)
    lora = _lora_params(ns, facts, geo, trained) if ns.use_lora else 0
    base = sum(comps[t].params for t in trained)
    sharded = base + lora
    # under LoRA the frozen base is built in the compute dtype where the master is float32 (TrainRank.setup)
    b = c if ns.use_lora and ns.param_dtype == "float32" else p
    master = (base * b + lora * p) / n
    others = [k for k in comps if (k.startswith("transformer") and k not in trained) or k == "vae"]
    if ns.loss_type == "sft_loss":
        others += [k for k in comps if k.startswith("text_encoder")]
    rest = held_bytes(ns.diffusion_model_family, comps, others, c)  # in c, a float32 part (Wan's VAE) in float32
    t_params = lora if ns.use_lora else sum(comps[t].params for t in trained)
    unit = max((comps[t].params + (lora // len(trained) if lora else 0)) / comps[t].blocks for t in trained)
    per_trained = p + 2 * p + (p if ns.use_ema else 0)
    what = f"LoRA rank {ns.lora_rank} on {'+'.join(trained)}" if ns.use_lora else f"full {'+'.join(trained)}"
    in_dtypes = ns.param_dtype if b == p else f"{ns.compute_dtype} (base) and {ns.param_dtype} (LoRA)"
    terms = [(f"master model: {sharded / 1e9:.2f} B sharded params in {in_dtypes} / {n} ranks", master),
             (f"parts not trained ({'+'.join(others) or 'none'}) in {ns.compute_dtype}"
              f"{_float32_note(ns.diffusion_model_family, others, ns.compute_dtype)}", rest),
             (f"one all-gathered block ({unit / 1e9:.3f} B params) and its gradient in {ns.compute_dtype}",
              2 * unit * c),
             (f"trained state {what}: {t_params / 1e9:.3f} B params x {per_trained} B / {n} ranks (reduce-scattered "
              f"grads, AdamW{', EMA' if ns.use_ema else ''})", t_params * per_trained / n)]
    models = master + rest
    optimizer_state = t_params * (per_trained - p) / n
    transient = 2 * unit * c + t_params * p / n  # the gathered block, the sharded grads (None between steps)
    act_term, act_bytes = _activations(ns, plan, facts, geo, trained, c)
    terms += [act_term, ("CUDA context and workspaces", CUDA_CONTEXT_GIB * GIB)]
    role = RoleEstimate("train rank", terms, models=models, optimizer_state=optimizer_state,
                        activations=act_bytes + transient, synced=t_params * p / n,
                        saved=t_params * p / n + optimizer_state)
    return role, _train_knobs(ns, plan, trained, copy=False)


def _activations(ns: Namespace, plan, facts: ModelFacts, geo: Geometry, trained: list[str], c: int,
                 graph_only: bool = False) -> tuple[tuple[str, float], float]:
    """The activations of the largest trained transformer: (term, bytes). `graph_only`: only the
    forwards that keep a graph (the unconditional branch runs without one unless
    --train-uncond-branch); the steady-state lines count both, as they always have."""
    comps = facts.components
    big = max(trained, key=lambda n: comps[n].hidden * comps[n].blocks)
    hidden, blocks = comps[big].hidden, comps[big].blocks
    image, text = _tokens(ns, geo, _text_tokens(ns))
    tokens = image + text
    both = _guided(ns) and (not graph_only or getattr(ns, "train_uncond_branch", False))
    forwards = _pairs_per_forward(ns, plan) * (2 if both else 1)
    per_block = ACT_VALUES_PER_TOKEN * tokens * hidden * c
    if ns.gradient_checkpointing:
        per_forward = blocks * tokens * hidden * c + per_block
        how = "block inputs (gradient checkpointing)"
    else:
        per_forward = blocks * per_block
        how = f"{ACT_VALUES_PER_TOKEN} values/token/hidden per block"
    term = (f"activations: {forwards} forwards x {tokens} tokens x {hidden} hidden x {blocks} blocks, {how}",
            forwards * per_forward)
    return term, term[1]


def _train_knobs(ns: Namespace, plan, trained: list[str], copy: bool) -> list[str]:
    knobs = []
    if getattr(ns, "train_backend", "dp") != "fsdp":
        knobs.append("--train-backend fsdp (shards weights, grads and AdamW state over the train ranks)")
    if ns.colocate and not (getattr(ns, "offload_train", False) and getattr(ns, "offload_rollout", False)):
        knobs.append("--offload-train --offload-rollout (the rank and the engine take turns on the GPU)")
    if not ns.use_lora:
        knobs.append("--use-lora (trains adapters instead of every weight)")
    if len(trained) > 1:
        knobs.append(f"train fewer components (--update-weight-target-module {trained[0]})")
    if not ns.gradient_checkpointing:
        knobs.append("--gradient-checkpointing")
    if _pairs_per_forward(ns, plan) > 1:
        knobs.append("a smaller --micro-batch-size / --micro-batch-size-sample")
    if copy and ns.param_dtype == "float32":
        knobs.append(f"--param-dtype {ns.compute_dtype} (drops the float32 master copy)")
    return knobs


def _float32_note(family: str, parts, dtype: str) -> str:
    kept = [n for n in parts if get_family_facts(family).runs_in_float32(n)] if dtype != "float32" else []
    return f" ({'+'.join(kept)} in float32)" if kept else ""


def _engine(ns: Namespace, plan, facts: ModelFacts, geo: Geometry) -> tuple[RoleEstimate, list[str]]:
    r = DTYPE_BYTES[ns.rollout_dtype]
    comps = facts.components
    params = sum(f.params for f in comps.values())
    transformers = [n for n in comps if n.startswith("transformer")]
    big = max(transformers, key=lambda n: comps[n].hidden * comps[n].blocks)
    image, text = _tokens(ns, geo, _text_tokens(ns))
    weights = held_bytes(ns.diffusion_model_family, comps, comps, r)
    # an engine forwards a whole microgroup at once, and SD3 / LTX add its negative prompts to the call
    group = ns.rollout_microgroup_size or ns.n_samples_per_prompt
    batch = group * (2 if _guided(ns) and ns.diffusion_model_family in CFG_IN_ONE_CALL else 1)
    terms = [(f"pipeline {params / 1e9:.2f} B params in {ns.rollout_dtype}"
              f"{_float32_note(ns.diffusion_model_family, comps, ns.rollout_dtype)}", weights),
             (f"one block's activations over {batch} sequence(s) (no graph)",
              ACT_VALUES_PER_TOKEN * (image + text) * comps[big].hidden * r * batch)]
    frames = ns.diffusion_output_num_frames
    chunk = frames if geo.decode_chunk_frames == 0 else min(frames, geo.decode_chunk_frames)
    terms.append((f"VAE decode of {group} x {chunk} frame(s)",
                  VAE_DECODE_MAPS * VAE_DECODE_CHANNELS * group * chunk * (ns.diffusion_height // geo.decode_stride)
                  * (ns.diffusion_width // geo.decode_stride) * part_bytes(ns.diffusion_model_family, "vae", r)))
    latent = image * geo.latent_channels * math.prod(geo.patch)
    steps = ns.diffusion_num_steps
    per_sample = (steps + 1 + (steps if ns.diffusion_debug_mode else 0)) * latent * 4
    terms.append((f"trajectories of {group} samples in float32", group * per_sample))
    terms.append(("CUDA context and workspaces", CUDA_CONTEXT_GIB * GIB))
    knobs = []
    if ns.rollout_dtype == "float32":
        knobs.append("--rollout-dtype bfloat16 (with --compute-dtype bfloat16)")
    if ns.colocate:
        knobs.append("drop --colocate and give engines their own GPUs (--rollout-num-gpus)")
    working = sum(b for _, b in terms) - weights - CUDA_CONTEXT_GIB * GIB
    return RoleEstimate("engine", terms, models=weights, activations=working, trajectories=group * per_sample), knobs


def _reward(ns: Namespace, workers_per_gpu: int) -> RoleEstimate | None:
    if ns.rm_type != "pickscore" or not ns.pickscore_model_path:
        return None
    facts = model_facts(ns.pickscore_model_path)
    if facts is None:
        return None
    params = sum(f.params for f in facts.components.values())
    return RoleEstimate("reward worker", [(f"scorer {params / 1e9:.2f} B params in float32", params * 4),
                                          ("CUDA context", CUDA_CONTEXT_GIB * GIB)], workers_per_gpu)


def build_memory_plan(ns: Namespace, plan) -> MemoryPlan:
    """The estimate for a validated namespace (validate_args has filled in the derived values)."""
    if ns.device == "cpu":
        return MemoryPlan(["memory plan: --device cpu, no GPU budget to check"], available=False)
    from miles.flags.validation import gpu_layout, has_rollout_engines, train_gpus

    facts = model_facts(ns.hf_checkpoint)
    geo = GEOMETRY[ns.diffusion_model_family]
    transformers = [] if facts is None else [n for n in facts.components if n.startswith("transformer")]
    if facts is None or not transformers or any(facts.components[n].hidden is None or facts.components[n].blocks
                                                 is None for n in transformers):
        why = ("is not on disk and not in miles/plan/model_table.py" if facts is None else
               "has no transformer config with num_attention_heads, attention_head_dim and num_layers")
        return MemoryPlan([f"memory plan: estimate unavailable: {ns.hf_checkpoint} {why}"], available=False)
    gpu_gb = gpu_memory_gb(ns)  # NVML only when there is an estimate to compare
    budget = gpu_gb * (1 - HEADROOM_FRACTION)
    head = (f"memory plan (per GPU, GiB; budget {budget:.1f} = --gpu-memory-gb {gpu_gb:g} minus "
            f"{HEADROOM_FRACTION:.0%} headroom)")
    layout = gpu_layout(ns)
    train, train_knobs = _train_rank(ns, plan, facts, geo)
    gpus: list[GpuEstimate] = []
    train_gpu = GpuEstimate("train GPU", [train], list(train_knobs))
    engines = has_rollout_engines(ns)
    engine, engine_knobs = _engine(ns, plan, facts, geo) if engines else (None, [])
    if engine is not None and ipc_push(ns):  # held from the push path's forming on, every phase
        train.terms.append(("IPC push buffer, reused by every push (the largest bucket; the engine stages nothing)",
                            _bucket(ns, _wire(ns, train))))
    if engine is not None and ns.colocate:
        train_gpu.roles.append(engine)
        train_gpu.knobs += engine_knobs
        train_gpu.phases = offload_phases(ns, train, engine)
    reward_note = ""
    if ns.loss_type != "sft_loss" and ns.rm_num_gpus_per_worker > 0:
        if ns.colocate_reward:
            per_gpu = math.ceil(ns.rm_num_workers / max(1, train_gpus(ns)))
            reward = _reward(ns, per_gpu)
            if reward is not None:
                train_gpu.roles.append(reward)
                train_gpu.phases = {k: v + reward.total for k, v in train_gpu.phases.items()}
        else:
            per_gpu = min(ns.rm_num_workers, max(1, int(1 / ns.rm_num_gpus_per_worker + 1e-9)))
            reward = _reward(ns, per_gpu)
            if reward is not None:
                gpus.append(GpuEstimate("reward GPU", [reward], ["raise --rm-num-gpus-per-worker"]))
        if reward is None:
            reward_note = f"reward worker: scorer {ns.rm_type} not estimated (no known checkpoint)"
    gpus.insert(0, train_gpu)
    if engine is not None and not ns.colocate:
        gpus.insert(1, GpuEstimate("rollout GPU", [engine], engine_knobs))
    lines = [f"{head}; facts from the {facts.source}"]
    for g in gpus:
        verdict = "fits" if g.total / GIB <= budget else "DOES NOT FIT"
        lines.append(f"  {g.name}: {g.total / GIB:.1f} GiB ({verdict})")
        if g.phases:
            lines.append("    peak of the phases (offload): " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in g.phases.items()))
        for role in g.roles:
            times = f" x {role.count_per_gpu} per GPU" if role.count_per_gpu > 1 else ""
            lines.append(f"    {role.role}{times}: {role.total / GIB:.1f}")
            for what, b in role.terms:
                lines.append(f"      {b / GIB:8.2f}  {what}")
    if reward_note:
        lines.append(f"  {reward_note}")
    factor = _sharding_factor(ns)
    if getattr(ns, "train_backend", "dp") == "fsdp":
        lines.append(f"  train ranks {layout.train}, sharding factor {factor} (--train-backend fsdp: master params, "
                     f"grads and AdamW state / {factor}, one block all-gathered in {ns.compute_dtype} at a time)")
    else:
        lines.append(f"  train ranks {layout.train}, sharding factor 1 (data-parallel backend: every rank holds the "
                     f"whole model)")  # the dry snapshots hold this line: keep its words
    host = build_host_plan(ns, plan, facts, train, engine)
    lines += host.lines() + eval_lines(ns, plan, facts)
    return MemoryPlan(lines, gpus, budget, gpu_gb, host=host)


def offload_phases(ns: Namespace, train: RoleEstimate, engine: RoleEstimate) -> dict[str, float]:
    """Bytes resident on a shared GPU in each phase, when an offload flag is on (else {}: the sum)."""
    offload_train, offload_rollout = getattr(ns, "offload_train", False), getattr(ns, "offload_rollout", False)
    if not (offload_train or offload_rollout):
        return {}
    # a side that does not compute in a phase holds no activations in it
    phases = {"training": train.total + engine.total - engine.activations - (engine.models if offload_rollout else 0.0),
              "rollout": engine.total + train.total - train.activations - (
                  train.models + train.optimizer_state if offload_train else 0.0)}
    # nobody computes; the rank holds (offloaded: brings back) only what the update reads, and
    # bucketed sync one bucket on each side
    ipc = _bucket(ns, _wire(ns, train)) if ipc_push(ns) else 0.0  # in train.total already
    rank = train.synced + CUDA_CONTEXT_GIB * GIB + ipc if offload_train else train.total - train.activations
    phases["weight sync"] = engine.total - engine.activations + rank + (0.0 if ipc_push(ns) else sync_buckets(ns))
    return phases


def ipc_push(ns: Namespace) -> bool:
    """Colocated bucketed sync pushes through IPC handles (miles.ray.weight_sync_group.push_transport):
    each train rank keeps one reused buffer of the largest bucket, the engine copies out of it."""
    return bool(getattr(ns, "colocate", False)) and getattr(ns, "weight_sync", "bucketed") == "bucketed"


def sync_buckets(ns: Namespace) -> float:
    """The bytes a push stages: the broadcast one bucket on the sender and one on the receiver;
    IPC the rank's one buffer (the engine stages nothing)."""
    from miles.flags.validation import DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE

    if getattr(ns, "weight_sync", "bucketed") != "bucketed":
        return 0.0
    return (1.0 if ipc_push(ns) else 2.0) * (getattr(ns, "update_weight_buffer_size", None)
                                             or DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE)


def plan_and_check(ns: Namespace, plan) -> MemoryPlan:
    """build_memory_plan, then refuse an estimate over budget (MemoryPlanError, a ValueError)."""
    memory = build_memory_plan(ns, plan)
    memory.check()
    return memory


# -- the phases of a run (setup, train, weight push, checkpoint save, rollout) and host memory --------

PHASES = ("setup", "train", "weight push", "checkpoint save", "rollout")  # one rollout's order
# a resumed run, before its first rollout: the rank's whole state back from the files while the
# engine holds the weights it loaded at setup (not replayed: the replay writes no files to read)
RESUME = "checkpoint load"


@dataclass
class PhasePlan:
    """Bytes each GPU holds in each phase (allocations; the CUDA context is `processes` x
    CUDA_CONTEXT_GIB on top), and each node's host memory in each phase (`host`). Checked against
    the replay of the real code (miles.replay, docs/memory-plan.md)."""

    gpus: dict[str, dict[str, float]]
    processes: dict[str, int]
    host: HostPlan
    budget_gib: float
    gpu_memory_gb: float

    def with_context(self, gpu: str, phase: str) -> float:
        return self.gpus[gpu][phase] + self.processes[gpu] * CUDA_CONTEXT_GIB * GIB


def phase_plan(ns: Namespace, plan) -> PhasePlan | None:
    """Each phase of one rollout, in the order the loop runs them (None: no estimate, as for
    build_memory_plan). Per role (bytes, no CUDA context; the role estimates' fields):

    train rank  M models, O optimizer state, A activations and gradients, S what a weight update reads
      setup M (each part loaded straight into its final dtype and shard) | train M + O + A |
      checkpoint load (a resume, before the first rollout; the engine as set up) M + O |
      weight push (offloaded: S, else M + O) + one bucket | checkpoint save M + O |
      rollout (offloaded: nothing, else M + O)
    engine      W weights, its forward's working set, the microgroup's trajectories (on the host)
      setup W | train, checkpoint save (offloaded after sampling and after an update: nothing,
      else W) | weight push W + one bucket (IPC: W) | rollout W + working set
    IPC (colocated): the rank's buffer in every phase after setup (its one bucket during the push)
    reward workers: their scorers, every phase.
    Host memory per node and phase: miles.plan.host_plan (the plan's `host`)."""
    memory = build_memory_plan(ns, plan)
    if not memory.available or not memory.gpus:
        return None
    from miles.flags.validation import has_rollout_engines

    facts = model_facts(ns.hf_checkpoint)
    geo = GEOMETRY[ns.diffusion_model_family]
    train, _ = _train_rank(ns, plan, facts, geo)
    c = DTYPE_BYTES[ns.compute_dtype]
    trained = _trained(ns, facts)
    train.activations += (_activations(ns, plan, facts, geo, trained, c, graph_only=True)[1]
                          - _activations(ns, plan, facts, geo, trained, c)[1])
    engine = _engine(ns, plan, facts, geo)[0] if has_rollout_engines(ns) else None
    rank_phases = _rank_phases(ns, train, engine)
    engine_phases = _engine_phases(ns, engine, train) if engine is not None else None
    gpus: dict[str, dict[str, float]] = {}
    processes: dict[str, int] = {}
    for g in memory.gpus:
        phases = dict.fromkeys((*PHASES, RESUME), 0.0)
        count = 0
        for role in g.roles:
            per_phase = {"train rank": rank_phases, "engine": engine_phases}.get(role.role)
            ctx = CUDA_CONTEXT_GIB * GIB * role.count_per_gpu
            for phase in (*PHASES, RESUME):
                phases[phase] += per_phase[phase] if per_phase else role.total - ctx
            count += role.count_per_gpu
        gpus[g.name] = phases
        processes[g.name] = count
    return PhasePlan(gpus, processes, memory.host, memory.budget_gib, memory.gpu_memory_gb)


def _bucket(ns: Namespace, synced_bytes: float) -> float:
    """One side's bucket: the buffer size, or the whole update when it is smaller."""
    per_side = sync_buckets(ns) / (1 if ipc_push(ns) else 2)
    return min(per_side, synced_bytes)


def _wire(ns: Namespace, train: RoleEstimate) -> float:
    """A push's bytes in the rollout dtype (the synced tensors are counted in the compute dtype)."""
    return train.synced * DTYPE_BYTES[ns.rollout_dtype] / max(1, DTYPE_BYTES[ns.compute_dtype])


def _rank_phases(ns: Namespace, train: RoleEstimate, engine: RoleEstimate | None) -> dict[str, float]:
    offload = getattr(ns, "offload_train", False)
    m, o, a, synced = train.models, train.optimizer_state, train.activations, train.synced
    wire = _wire(ns, train)
    held = _bucket(ns, wire) if engine is not None and ipc_push(ns) else 0.0  # the IPC buffer, from setup's end
    idle = (0.0 if offload else m + o) + held
    push = (synced if offload else m + o) + _bucket(ns, wire)
    if getattr(ns, "ema_rollout_policy", "live") == "ema" and getattr(ns, "train_backend", "dp") != "fsdp":
        # the engines get the old policy: its weights swapped in (a backup of the trained ones in p)
        # and every synced tensor cloned while swapped (TrainRank.synced_tensors)
        c, pb = DTYPE_BYTES[ns.compute_dtype], DTYPE_BYTES[ns.param_dtype]
        push += synced + synced / c * pb
    return {"setup": m, "train": m + o + a + held, "weight push": push, "checkpoint save": m + o + held,
            "rollout": idle, RESUME: m + o + held}


def _engine_phases(ns: Namespace, engine: RoleEstimate, train: RoleEstimate) -> dict[str, float]:
    w = engine.models
    working = engine.activations - engine.trajectories
    staged = 0.0 if ipc_push(ns) else _bucket(ns, _wire(ns, train))  # IPC: copied out of the rank's buffer
    offloaded = getattr(ns, "offload_rollout", False)  # off the GPU after sampling and after each update
    return {"setup": w, "train": 0.0 if offloaded else w, "weight push": w + staged,
            "checkpoint save": 0.0 if offloaded else w, "rollout": w + working, RESUME: w}
