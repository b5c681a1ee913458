"""The host side of the memory plan: per node, what its processes and Ray's object store hold in
host memory in each phase of a rollout, against `--host-memory-gb` minus the plan's headroom. Torch-free.

Where each process runs (`node_roles`): the driver on node 0 (the head); `--actor-num-gpus-per-node`
train ranks on each of the `--actor-num-nodes` train nodes, and their engines beside them
(`--colocate`) or on the GPUs left there; reward workers asking for GPUs beside the engines
(`--colocate-reward`), else on a node beyond the train nodes when the job has one (a reward node),
else on node 0; CPU reward workers on node 0.

What each holds (bytes; memory_plan's role estimates give M, O, W):
  every process   its runtime: PROCESS_HOST_GIB (Python, torch, diffusers; on a GPU the CUDA
                  runtime's and libraries' host side), CPU_PROCESS_HOST_GIB for a CPU-only one
  every node      Ray's own processes (raylet, object manager, agent; GCS and dashboard on node 0):
                  RAY_NODE_HOST_GIB
  train rank      setup: the largest part it loads through the host (load_model moves each part to
                  the device as it loads it; a sharded rank reads its trained rows one weight at a
                  time) | --offload-train: its models and optimizer state in host arenas of exactly
                  their size (miles.models.offload: one page-locked arena per part, so torch's
                  pinned allocator and its power-of-two rounding do not apply), held from then on |
                  train: its shard of the rollout, fetched from the object store | checkpoint save
                  (written in the background, miles.backends.checkpoint_writer): a sharded rank's
                  host copy of its checkpoint shard (DCP's async save stages it whole); a
                  data-parallel rank 0's host copy of the whole checkpoint, plus the bytes of the
                  largest file safetensors makes while writing it. The copies live until the
                  write ends, which may overlap the next rollout's first phases
  engine          setup: its largest part | --offload-rollout: its weights' arena | rollout: one
                  microgroup's whole denoising path (every step's latents, model outputs in debug
                  mode), twice: its steps as made and their stack (sampler._denoise)
  reward worker   setup: its scorer in float32 while it loads
  driver          prompts, references, rewards and advantages (DRIVER_BYTES_PER_SAMPLE a sample) and
                  the progress picture's thumbnails: never the samples (miles.ray.rollout_manager)
  object store    rollout and train: each sample its engine made, as the train ranks read it (the
                  trained steps' latents in float32, the model outputs the probe compares), its
                  group's conditioning once, its reward frames; an eval: its reward frames only
"""

from __future__ import annotations

import math
from argparse import Namespace
from dataclasses import dataclass, field

GIB = 1024 ** 3
DEFAULT_HOST_MEMORY_GB = 1024.0  # an 8-GPU H100/H200 node as the recipes are written for
HEADROOM_FRACTION = 0.10  # as the GPU budget's
PROCESS_HOST_GIB = 3.0  # a GPU process's own host memory: an assumption (no GPU measured it yet)
CPU_PROCESS_HOST_GIB = 1.0  # the driver or a CPU reward worker (benchmarks/bench_host_memory.py: about 0.5)
RAY_NODE_HOST_GIB = 2.0
DRIVER_BYTES_PER_SAMPLE = 4096  # references, metadata, reward (benchmarks/bench_host_memory.py: under 1 KiB)
THUMBNAIL_BYTES = 16 * 3 * 128 * 128  # miles.ray.rollout_manager.THUMBNAILS at engine_store.THUMBNAIL_SIDE
PHASES = ("setup", "train", "weight push", "checkpoint save", "rollout")


class HostPlanError(ValueError):
    """A node's host memory over its budget; the message names the node, the roles and fixes."""


@dataclass(frozen=True)
class SampleBytes:
    """A sample's parts as they sit in host memory (`sample_bytes` makes it from the flags)."""

    trajectory: float  # as the object store keeps it and a train rank reads it (probed outputs averaged in)
    cond: float  # one prompt group's conditioning
    reward_frames: float  # what its reward workers read
    microgroup_path: float  # one microgroup's whole path on its engine's host
    full_trajectory: float  # the whole path and the decoded sample in float32: what the driver once held
    # (besides the conditioning)


@dataclass(frozen=True)
class NodeRoles:
    index: int
    driver: bool
    ranks: int
    engines: int
    gpu_rewards: int
    cpu_rewards: int
    samples: int  # samples its engines make per rollout
    groups: int  # prompt groups they make
    eval_samples: int


@dataclass
class NodeHost:
    roles: NodeRoles
    parts: dict[str, dict[str, float]]  # what -> phase -> bytes (all processes of that kind on the node)

    @property
    def name(self) -> str:
        r = self.roles
        held = [("driver" if r.driver else ""), f"{r.ranks} train ranks" if r.ranks else "",
                f"{r.engines} engines" if r.engines else "",
                f"{r.gpu_rewards + r.cpu_rewards} reward workers" if r.gpu_rewards + r.cpu_rewards else ""]
        return f"node {r.index} ({', '.join(h for h in held if h)})"

    def phase(self, phase: str) -> float:
        return sum(p.get(phase, 0.0) for p in self.parts.values())

    @property
    def total(self) -> float:
        return max(self.phase(p) for p in PHASES)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase)


@dataclass
class HostPlan:
    nodes: list[NodeHost]
    host_memory_gb: float
    notes: list[str] = field(default_factory=list)
    roles: list[NodeRoles] = field(default_factory=list)  # what it was composed from (the replay recomposes)
    procs: "ProcessBytes | None" = None
    sample: "SampleBytes | None" = None

    @property
    def budget_gib(self) -> float:
        return self.host_memory_gb * (1 - HEADROOM_FRACTION)

    def lines(self) -> list[str]:
        out = [f"host memory plan (per node, GiB; budget {self.budget_gib:.1f} = --host-memory-gb "
               f"{self.host_memory_gb:g} minus {HEADROOM_FRACTION:.0%} headroom)"]
        for node in self.nodes:
            verdict = "fits" if node.total / GIB <= self.budget_gib else "DOES NOT FIT"
            peak = node.peak_phase
            out.append(f"  {node.name}: {node.total / GIB:.1f} GiB at {peak} ({verdict})")
            for what, phases in node.parts.items():
                if phases.get(peak, 0.0):
                    out.append(f"    {phases[peak] / GIB:8.2f}  {what}")
        out += [f"  {n}" for n in self.notes]
        return out

    def check(self) -> None:
        over = [n for n in self.nodes if n.total / GIB > self.budget_gib]
        if not over:
            return
        node = over[0]
        parts = ", ".join(f"{what} {p.get(node.peak_phase, 0.0) / GIB:.1f} GiB" for what, p in node.parts.items()
                          if p.get(node.peak_phase, 0.0))
        raise HostPlanError(
            f"host memory plan: {node.name} needs an estimated {node.total / GIB:.1f} GiB at {node.peak_phase} "
            f"({parts}), over its budget of {self.budget_gib:.1f} GiB (--host-memory-gb {self.host_memory_gb:g} minus "
            f"{HEADROOM_FRACTION:.0%} headroom); what would help: fewer engines or train ranks per node "
            f"(--actor-num-gpus-per-node), a smaller rollout (--rollout-batch-size, --n-samples-per-prompt), fewer eval "
            f"prompts (--eval-num-prompts), or a node with more memory (--host-memory-gb)")


def host_memory_gb(ns: Namespace) -> float:
    value = getattr(ns, "host_memory_gb", None)
    return DEFAULT_HOST_MEMORY_GB if value is None else float(value)


# -- where the processes run ---------------------------------------------------------------------

def node_roles(ns: Namespace, engines: int, eval_prompts: int) -> list[NodeRoles]:
    """Each node's processes and the samples its engines make (see the module docstring)."""
    nodes = max(ns.num_nodes or ns.actor_num_nodes, ns.actor_num_nodes)
    ranks = [ns.actor_num_gpus_per_node if i < ns.actor_num_nodes else 0 for i in range(nodes)]
    engine_counts = _engines_per_node(ns, ranks, engines)
    gpu_rewards, cpu_rewards = _rewards_per_node(ns, ranks, engine_counts, nodes)
    samples = ns.rollout_batch_size * ns.n_samples_per_prompt
    out = []
    for i in range(nodes):
        share = engine_counts[i] / engines if engines else 0.0
        out.append(NodeRoles(i, i == 0, ranks[i], engine_counts[i], gpu_rewards[i], cpu_rewards[i],
                             math.ceil(samples * share), math.ceil(ns.rollout_batch_size * share),
                             math.ceil(eval_prompts * share)))
    return out


def _engines_per_node(ns: Namespace, ranks: list[int], engines: int) -> list[int]:
    if ns.colocate:
        return [min(r, engines) for r in ranks]
    out, left = [], engines
    for r in ranks:  # engines take the GPUs the train ranks leave, node by node
        here = min(left, ns.num_gpus_per_node - r) if r or len(out) == 0 else 0
        out.append(here)
        left -= here
    return out


def _rewards_per_node(ns: Namespace, ranks: list[int], engines: list[int], nodes: int) -> tuple[list[int], list[int]]:
    workers = 0 if ns.loss_type == "sft_loss" else int(ns.rm_num_workers or 0)
    gpu, cpu = [0] * nodes, [0] * nodes
    if not workers:
        return gpu, cpu
    if not ns.rm_num_gpus_per_worker:
        cpu[0] = workers
        return gpu, cpu
    if ns.colocate_reward and sum(engines):
        hosts = [i for i, e in enumerate(engines) for _ in range(e)]
        for w in range(workers):
            gpu[hosts[w % len(hosts)]] += 1
        return gpu, cpu
    spare = [i for i in range(nodes) if ranks[i] == 0]
    gpu[spare[0] if spare else 0] = workers
    return gpu, cpu


# -- what they hold -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProcessBytes:
    """The per-process inputs: memory_plan's role estimates, flattened."""

    rank_load: float  # the largest part a rank loads through the host
    rank_arena: float  # --offload-train: models + optimizer state (0 without)
    rank_arena_setup: float  # what is offloaded at the end of setup (the models: no optimizer state yet)
    rank_save: float  # a data-parallel rank 0's checkpoint host copies
    engine_load: float
    engine_arena: float  # --offload-rollout: the weights (0 without)
    scorer: float  # a GPU reward worker's scorer in float32
    rank_save_shard: float = 0.0  # a sharded rank's host copy of its checkpoint shard (every rank)


def plan_nodes(ns: Namespace, nodes: list[NodeRoles], procs: ProcessBytes, sample: SampleBytes) -> list[NodeHost]:
    return compose_nodes(ns, nodes, rank_phases(ns, procs, sample), engine_phases(procs, sample),
                         {"checkpoint save": procs.rank_save}, procs.scorer, sample)


def compose_nodes(ns: Namespace, nodes: list[NodeRoles], rank: dict[str, float], engine: dict[str, float],
                  rank0_copies: dict[str, float], scorer: float, sample: SampleBytes) -> list[NodeHost]:
    """Each node's parts from one train rank's and one engine's host bytes per phase (planned, or
    measured by the replay) and what only the plan models (runtimes, driver, rewards, object store)."""
    out = []
    for node in nodes:
        parts: dict[str, dict[str, float]] = {}
        add = lambda what, phases: parts.update({what: phases}) if any(phases.values()) else None  # noqa: E731
        runtimes = (node.ranks + node.engines + node.gpu_rewards) * PROCESS_HOST_GIB + (
            node.cpu_rewards + node.driver) * CPU_PROCESS_HOST_GIB + RAY_NODE_HOST_GIB
        add("process runtimes and Ray's daemons", dict.fromkeys(PHASES, runtimes * GIB))
        add("driver (prompts, references, rewards, thumbnails)",
            dict.fromkeys(PHASES, _driver_bytes(ns) if node.driver else 0.0))
        add(f"train ranks x {node.ranks}", {p: node.ranks * rank.get(p, 0.0) for p in PHASES})
        add("train rank 0's checkpoint copies", rank0_copies if node.index == 0 and node.ranks else {})
        add(f"engines x {node.engines}", {p: node.engines * engine.get(p, 0.0) for p in PHASES})
        add(f"reward workers x {node.gpu_rewards} (GPU)", {"setup": node.gpu_rewards * scorer})
        add("object store (this node's engines' samples)", _store_phases(node, sample))
        out.append(NodeHost(node, parts))
    return out


def _driver_bytes(ns: Namespace) -> float:
    return ns.rollout_batch_size * ns.n_samples_per_prompt * DRIVER_BYTES_PER_SAMPLE + THUMBNAIL_BYTES


def rank_phases(ns: Namespace, procs: ProcessBytes, sample: SampleBytes) -> dict[str, float]:
    ranks = max(1, ns.actor_num_nodes * ns.actor_num_gpus_per_node)
    samples = ns.rollout_batch_size * ns.n_samples_per_prompt
    per_rank = math.ceil(samples / ranks)
    groups = min(ns.rollout_batch_size, math.ceil(per_rank / ns.n_samples_per_prompt) + 1)
    shard = 0.0 if ns.loss_type == "sft_loss" else per_rank * sample.trajectory + groups * sample.cond
    arena = procs.rank_arena
    return {"setup": max(procs.rank_load, procs.rank_arena_setup), "train": arena + shard, "weight push": arena,
            "checkpoint save": arena + procs.rank_save_shard, "rollout": arena}


def engine_phases(procs: ProcessBytes, sample: SampleBytes) -> dict[str, float]:
    arena = procs.engine_arena
    return {"setup": procs.engine_load, "train": arena, "weight push": arena, "checkpoint save": arena,
            "rollout": arena + 2 * sample.microgroup_path}


def _store_phases(node: NodeRoles, sample: SampleBytes) -> dict[str, float]:
    if not node.engines:
        return {}
    rollout = node.samples * (sample.trajectory + sample.reward_frames) + node.groups * sample.cond
    evaluation = node.eval_samples * sample.reward_frames
    return {"rollout": max(rollout, evaluation), "train": rollout}


# -- from the flags and the checkpoint's facts ------------------------------------------------------

def build_host_plan(ns: Namespace, plan, facts, train, engine) -> HostPlan:
    """`train` and `engine`: memory_plan's role estimates (their `models` and `optimizer_state`);
    `engine` None without rollout engines."""
    from miles.plan.model_facts import GEOMETRY
    from miles.flags.validation import has_rollout_engines

    geo = GEOMETRY[ns.diffusion_model_family]
    engines = 0
    if engine is not None and has_rollout_engines(ns):
        from miles.plan.placement_plan import num_rollout_engines

        engines = num_rollout_engines(ns)
    eval_prompts, notes = _eval_prompts(ns)
    nodes = node_roles(ns, engines, eval_prompts if engines else 0)
    procs = _process_bytes(ns, facts, train, engine)
    sample = sample_bytes(ns, plan, facts, geo)
    notes.append(f"pinned: offload arenas of exactly their size (miles.models.offload, page-locked in place), "
                 f"no power-of-two rounding; per process {PROCESS_HOST_GIB:g} GiB of runtime assumed "
                 f"({CPU_PROCESS_HOST_GIB:g} for a CPU-only one)")
    return HostPlan(plan_nodes(ns, nodes, procs, sample), host_memory_gb(ns), notes, nodes, procs, sample)


def _eval_prompts(ns: Namespace) -> tuple[int, list[str]]:
    if not getattr(ns, "eval_interval", None):
        return 0, []
    if ns.eval_num_prompts:
        return ns.eval_num_prompts, []
    path = ns.eval_prompt_data or ns.prompt_data  # a path once parsed (miles.flags.public_flags)
    try:
        with open(path) as fh:
            return sum(1 for line in fh if line.strip()), []
    except (OSError, TypeError):
        return 0, [f"eval: {path} not readable here, its frames not counted (set --eval-num-prompts)"]


def _process_bytes(ns: Namespace, facts, train, engine) -> ProcessBytes:
    from miles.plan.model_facts import DTYPE_BYTES, GEOMETRY, _lora_params, _trained, part_bytes

    p, c, r = (DTYPE_BYTES[ns.param_dtype], DTYPE_BYTES[ns.compute_dtype], DTYPE_BYTES[ns.rollout_dtype])
    comps = facts.components
    trained = _trained(ns, facts)
    sharded = getattr(ns, "train_backend", "dp") == "fsdp"
    meta_built = sharded and ns.param_dtype == "float32"
    loaded = [n for n in comps if n.startswith("transformer") or n == "vae"
              or (ns.loss_type == "sft_loss" and n.startswith("text_encoder"))]
    through_host = [n for n in loaded if not (meta_built and n in trained)]  # sharded rows come one weight at a time
    family, load_bytes = ns.diffusion_model_family, (c if meta_built else p)
    rank_load = max((comps[n].params * part_bytes(family, n, load_bytes) for n in through_host), default=0)
    save = 0.0
    if not sharded and trained:  # rank 0's host copy of everything it saves, then one file's bytes at a time
        geo = GEOMETRY[ns.diffusion_model_family]
        per = [(_lora_params(ns, facts, geo, [n]) if ns.use_lora else comps[n].params) for n in trained]
        save = train.saved + max(per) * p
    offload_train, offload_rollout = getattr(ns, "offload_train", False), getattr(ns, "offload_rollout", False)
    scorer = _scorer_bytes(ns) if (ns.rm_num_gpus_per_worker or 0) > 0 else 0.0
    return ProcessBytes(
        rank_load=rank_load, rank_arena=(train.models + train.optimizer_state) if offload_train else 0.0,
        rank_arena_setup=train.models if offload_train else 0.0, rank_save=save,
        rank_save_shard=train.saved if sharded else 0.0,
        engine_load=max(f.params * part_bytes(family, n, r) for n, f in comps.items()) if engine is not None else 0.0,
        engine_arena=engine.models if engine is not None and offload_rollout else 0.0, scorer=scorer)


def _scorer_bytes(ns: Namespace) -> float:
    from miles.plan.model_facts import model_facts

    if ns.rm_type != "pickscore" or not ns.pickscore_model_path:
        return 0.0
    facts = model_facts(ns.pickscore_model_path)
    return 0.0 if facts is None else sum(f.params for f in facts.components.values()) * 4.0


def sample_bytes(ns: Namespace, plan, facts, geo) -> SampleBytes:
    """A sample's parts in host memory (see SampleBytes), from the flags and the family's geometry."""
    from miles.plan.model_facts import DTYPE_BYTES, _guided, _text_tokens, _tokens
    from miles.flags.reward_names import EIGHT_BIT_FRAMES

    image, _ = _tokens(ns, geo, _text_tokens(ns))
    latent = image * geo.latent_channels * math.prod(geo.patch) * 4  # float32, as the SDE step computes it
    steps, trained = ns.diffusion_num_steps, plan.num_trained_steps
    contiguous = ns.diffusion_step_strategy_path == "sde_window"
    kept = min(steps + 1, trained + 2 if contiguous else 2 * trained + 1)
    samples = plan.samples_per_rollout
    probed = _probed_pairs(ns, plan) * latent / max(1, samples)
    r = DTYPE_BYTES[ns.rollout_dtype]
    cond = _text_tokens(ns) * geo.text_dim * r * (2 if _guided(ns) else 1)
    frames, pixels = max(1, ns.diffusion_output_num_frames), 3 * ns.diffusion_height * ns.diffusion_width
    eight_bit = EIGHT_BIT_FRAMES.get(ns.rm_type or "")
    reward = min(frames, eight_bit) * pixels if eight_bit else frames * pixels * 4
    debug = steps if ns.diffusion_debug_mode else 0
    group = ns.rollout_microgroup_size or ns.n_samples_per_prompt
    return SampleBytes(trajectory=kept * latent + probed, cond=cond, reward_frames=reward,
                       microgroup_path=group * (steps + 1 + debug) * latent,
                       full_trajectory=(steps + 1 + debug) * latent + frames * pixels * 4)


def _probed_pairs(ns: Namespace, plan) -> int:
    """Pairs of a rollout whose model outputs the engines keep (miles.backends.rollout_shard.probed_outputs)."""
    if not ns.diffusion_debug_mode:
        return 0
    limit = ns.diffusion_debug_probe_micro_batches
    limit = (0 if ns.device == "cpu" else 1) if limit is None else limit
    if not limit:
        return plan.train_pairs
    return min(plan.train_pairs, plan.dp_size * limit * plan.pairs_per_forward)
