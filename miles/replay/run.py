"""One replay: a recipe's validated flags run through the project's own train-rank and engine
code on meta tensors, phase by phase, with live bytes counted per place and role.

Phases (each the real code; the seams are miles.replay.seams):
  setup            `TrainRank.setup` (its real --train-backend, sharding and offload), the engine's
                   `RolloutEngine(...)` load in --rollout-dtype, reward workers' scorer build
  rollout          one denoising step of the engine (`DiffusionModel.velocity`, guided as the
                   recipe guides) and the VAE decode of one sample, with the engine's microgroup's
                   whole path held on the host (its steps and their stack)
  train            `TrainRank.train` over a batch whose plan deals each rank exactly one
                   micro-batch: one forward + backward and one optimizer step (SFT: its items'
                   media and prompts' conditioning stand-ins, miles.replay.seams.sft_stand_ins)
  weight push      the bucketed sync: rank 0's `send_buckets` of its synced tensors and an engine's
                   `receive_buckets` into its own weights (each side resident as offload leaves it)
  checkpoint save  `TrainRank.save`
One rank (rank 0) and one engine are replayed; every rank of a recipe holds the same shapes.

Depth. A transformer's blocks are identical, and every byte a rank or an engine holds is a sum
over blocks plus a part outside them, so the bytes held at any one moment of a phase are affine in
the block count B: h(B) = a + b B. The phase's peak is the largest of those over its moments, and
that is affine only while the same moment is the largest: a transient that does not grow with B
(Wan2.2 SFT's VAE built beside its loaded text encoder, 12.77 GiB at 4 and 5 blocks) can be the
peak at small B and a moment that does (the end of setup, both experts' rows read: 12.37 GiB at 4
blocks, 12.71 at 5) at the released B. So a phase is cut into segments at marks the code
reaches the same number of times at every depth (`LiveMemory.mark`: each component's build, each
trained component's rows read, the optimizer step; miles.replay.seams), each role's peak in each
segment is extended on its own line, and the phase's peak is the largest of them (LTX-2.3 full's
train step: the backward holds the most at 4 and 5 blocks, the optimizer step, a segment of its
own, at 48). Within a segment the moment of the peak settles once B is large enough (FSDP2
gathers the next block while one runs; `_DEPTHS`).
`blocks=None` replays the released depth; `extrapolate=True` replays B = 4 and B = 5 and
returns, per segment, a + b B_real (the CPU tier: seconds instead of minutes). SD3.5 has two
kinds of blocks (its first 13 of 24 carry a second attention): it replays 4 blocks (all with
one), 5 with 4 of them and 5 with all 5, and extends each kind to its own count. Still not exact
where two moments of one segment trade places between the replayed depths and the released one
(docs/memory-plan.md gives the measured gaps).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
from argparse import Namespace
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles.replay.checkpoint import block_count, component_specs, dual_blocks, write_config_checkpoint
from miles.replay.memory import (ENGINE, HOST, RANK, REWARD, REWARD_GPU, ROLLOUT_GPU, TRAIN_GPU,  # noqa: F401  report reads them here
                                 LiveMemory, PhaseRecord)
from miles.replay.seams import fake_process_group, replay_seams, sft_stand_ins, staging_dir
from miles.replay.weight_push import weight_push

PHASES = ("setup", "train", "weight push", "checkpoint save", "rollout")  # a rollout's order, steady state
# FSDP2 gathers the next block while one runs, in forward and in backward, so the moment of the
# peak settles only from three blocks on: Qwen-Image's train-step peak rises 0.70 GiB from 2 to 3
# blocks, then 0.469 GiB a block from 3 to 4 and from 4 to 6; Wan2.2 SFT's host memory settles at 4
# (measured here, see docs/memory-plan.md)
_DEPTHS = (4, 5)


class ReplayUnavailable(ValueError):
    """Nothing to replay: a CPU run, or a checkpoint the committed table does not describe."""


@dataclass
class PhaseMeasure:
    phase: str
    place: str
    peak: int
    roles: dict[str, int]
    top: list[str] = field(default_factory=list)


@dataclass
class ReplayResult:
    key: str
    blocks: int | None
    measures: list[PhaseMeasure]
    processes: dict[str, dict[str, int]]  # place -> role -> processes of that role on it
    host_phases: dict[str, dict[str, int]]  # phase -> host memory of one train rank, of rank 0, of one engine
    collectives: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # phase -> why it was not replayed
    records: list[PhaseRecord] = field(default_factory=list)  # what the figures above are made from
    offload_layout: dict[str, tuple[int, int]] = field(default_factory=dict)  # part -> (arena bytes, rounded bytes)

    def record(self, phase: str) -> PhaseRecord:
        return next(r for r in self.records if r.name == phase)

    def measure(self, phase: str, place: str) -> PhaseMeasure | None:
        return next((m for m in self.measures if m.phase == phase and m.place == place), None)


def table_key(ns: Namespace) -> str:
    from miles.plan.memory_plan import _hub_repo_name, _table_key

    key = _table_key(ns.hf_checkpoint) if ns.hf_checkpoint else None
    if key is None:
        name = _hub_repo_name(ns.hf_checkpoint or "") or Path(ns.hf_checkpoint or "-").name
        raise ReplayUnavailable(f"{name}: not in the committed size table (miles/plan/model_table.py), "
                                f"so there is no config to build it from")
    return key


def replay(ns: Namespace, plan, blocks: int | None = None, extrapolate: bool = False) -> ReplayResult:
    if ns.device != "cuda":
        raise ReplayUnavailable("--device cpu: no GPU to replay")
    key = table_key(ns)
    _, specs = component_specs(key)
    configs = [s["config"] for n, s in specs.items() if n.startswith("transformer")]
    real = max(block_count(c) or 0 for c in configs)
    dual = max(dual_blocks(c) for c in configs)
    low, high = _DEPTHS
    if not extrapolate or real <= high:  # (a proxy shallower than the replayed depths: replayed as it is)
        return _replay_once(ns, plan, key, blocks)
    base = _replay_once(ns, plan, key, low, min(dual, low) if dual else None)
    if not dual:  # identical blocks: base + (B - low) x one block
        return _extrapolated(base, [(_replay_once(ns, plan, key, high), real - low)])
    # SD3.5: its first `dual` blocks carry a second attention; one more block of each kind
    plain = _replay_once(ns, plan, key, high, low)
    second = _replay_once(ns, plan, key, high, high)
    return _extrapolated(base, [(plain, real - dual), (second, dual - low)])


def _extrapolated(base: ReplayResult, steps: list[tuple[ReplayResult, int]]) -> ReplayResult:
    """base + sum of count x (one block more, of that kind) over the kinds of block, for every
    segment of every phase; the figures are then made from these records as from a replay's."""
    deeper = steps[0][0]
    records = [_record_line(record, [(more.record(record.name), count) for more, count in steps])
               for record in base.records]
    tops = {(m.phase, m.place): m.top for m in deeper.measures}
    measures = _measures(records, deeper.processes, lambda record, place: tops.get((record.name, place), []))
    return dataclasses.replace(deeper, blocks=None, measures=measures, host_phases=process_host(records),
                               records=records, offload_layout=_extrapolated_layout(base, steps))


def _extrapolated_layout(base: ReplayResult, steps: list[tuple[ReplayResult, int]]) -> dict[str, tuple[int, int]]:
    """Each offloaded part's arena and rounded bytes at the released depth: the arena's affine in the
    blocks; the rounding is per storage, so every block's storages round alike (a block's share)."""
    def line(part: str, i: int) -> int:
        return max(0, base.offload_layout[part][i] + sum(
            count * (more.offload_layout[part][i] - base.offload_layout[part][i]) for more, count in steps))

    return {part: (line(part, 0), line(part, 1)) for part in base.offload_layout}


def _record_line(base: PhaseRecord, steps: list[tuple[PhaseRecord, int]]) -> PhaseRecord:
    """A phase at the released depth: its start, and each role's peak the largest of its segments'
    peaks, each segment's extended on its own line (see Depth in the module's docstring)."""
    labels = [segment.label for segment in base.segments]
    for more, _ in steps:
        if [segment.label for segment in more.segments] != labels:
            raise RuntimeError(f"phase {base.name!r}: its segments differ between depths ({labels} and "
                               f"{[segment.label for segment in more.segments]}); a mark must be reached "
                               f"the same number of times at every depth")

    def line(value) -> int:
        return max(0, value(base) + sum(count * (value(more) - value(base)) for more, count in steps))

    keys = {k for r in (base, *(more for more, _ in steps)) for k in (*r.start, *r.peak)}
    start = {k: line(lambda r, k=k: r.start.get(k, 0)) for k in keys}
    peak = {k: max(start[k], *(line(lambda r, i=i, k=k: r.segments[i].peak.get(k, 0)) for i in range(len(labels))))
            for k in keys}
    return PhaseRecord(base.name, start, peak)


def _replay_once(ns: Namespace, plan, key: str, blocks: int | None, dual: int | None = None) -> ReplayResult:
    from miles.flags.validation import has_rollout_engines, train_gpus

    world = train_gpus(ns)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    memory = LiveMemory()
    with tempfile.TemporaryDirectory(prefix="miles-replay-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        path = write_config_checkpoint(key, root / "model", blocks, dual)
        args = copy.copy(ns)
        args.hf_checkpoint, args.save = str(path), str(root / "save")
        stack.enter_context(fake_process_group(world))
        stack.enter_context(replay_seams(memory))
        # what the code makes without naming a device is made where a GPU process makes it and moves it
        # (a module's layers, PEFT's adapters: built on the CPU, then moved to the device, a move that
        # meta cannot tell apart from no move): on the device; a tensor asked for on the CPU is host memory
        stack.enter_context(torch.device("meta"))
        stack.enter_context(memory.mode)
        try:
            result = _phases(memory, args, plan, world, has_rollout_engines(ns), root, key, blocks)
        finally:
            torch.set_num_threads(threads)
            torch.set_rng_state(rng)
    return result


def _places(args) -> dict[str, str]:
    engine = TRAIN_GPU if args.colocate else ROLLOUT_GPU
    reward = TRAIN_GPU if args.colocate_reward else REWARD_GPU
    return {RANK: TRAIN_GPU, ENGINE: engine, REWARD: reward}


def _phases(memory: LiveMemory, args, plan, world: int, engines: bool, root: Path, key: str,
            blocks: int | None) -> ReplayResult:
    from miles.backends.actor import TrainRank

    places = _places(args)
    skipped: dict[str, str] = {}
    rank = engine = None
    with memory.measuring("setup"):
        with memory.at(TRAIN_GPU, RANK):
            rank = TrainRank(args, _one_micro_batch_plan(plan), 0, world)
            rank.device = torch.device("meta")
            rank.setup()
        if engines:
            with memory.at(places[ENGINE], ENGINE):
                engine = _engine(args)
                spec = rank.lora_spec()
                if spec is not None:  # as the rollout manager does once the ranks are up
                    engine.apply_lora({"rank": spec.rank, "alpha": spec.alpha,
                                       "target_modules": list(spec.target_modules), "components": rank.components})
        rewards = _reward_workers(memory, args, places[REWARD])
    if engine is not None:  # the loop samples first: the engine then stands as it does after every rollout
        from miles.rollout.engine_offload import resident_while_sampling

        with memory.at(places[ENGINE], ENGINE), resident_while_sampling(engine.offloaded_weights):
            pass
    _name(memory, rank, engine)
    if args.loss_type == "sft_loss":
        with memory.at(HOST, RANK):
            batches = _sft_batches(args, rank)
        with memory.measuring("train"), sft_stand_ins(lambda: _conditioning(rank.fmodel, args, rank.fmodel.dtype)):
            with memory.at(TRAIN_GPU, RANK):
                for batch in batches:  # one step on each trained expert, then the first again (as below)
                    rank.train(batch)
        del batches
    else:
        with memory.at(HOST, RANK):
            batches, held = _batches(args, rank, plan)
        with memory.measuring("train"):
            with memory.at(TRAIN_GPU, RANK):
                for batch in batches:  # one step on each trained expert: each one's AdamW state exists after
                    rank.train(batch)
        del batches, batch, held
    _name(memory, rank, engine)
    if engine is not None:
        with memory.measuring("weight push"):
            weight_push(memory, args, rank, engine, places)
    else:
        skipped["weight push"] = "no engines"
    with memory.measuring("checkpoint save"):
        with memory.at(TRAIN_GPU, RANK):
            rank.save(str(staging_dir(root)))
    if engine is not None:
        with memory.measuring("rollout"):
            with memory.at(places[ENGINE], ENGINE):
                _rollout_step(memory, args, engine)
    else:
        skipped["rollout"] = "no engines (SFT trains on a dataset)"
    processes = _processes(args, places, engines, rewards)
    measures = _measures(memory.phases, processes, lambda record, place: _top(memory, record, place))
    calls = list(rank.comm.calls)
    return ReplayResult(key, blocks, measures, processes, process_host(memory.phases), calls, skipped, memory.phases,
                        offload_layout(rank, engine))


def _one_micro_batch_plan(plan):
    """The plan with each rank dealt exactly one micro-batch and one optimizer step."""
    spec = plan.micro_batching
    steps = spec.tile_steps if spec.is_2d else 1
    per_rank = plan.pairs_per_forward
    samples = plan.dp_size * per_rank // steps
    return dataclasses.replace(plan, num_trained_steps=steps, samples_per_rollout=samples, num_steps_per_rollout=1,
                               train_pairs=samples * steps, pairs_per_rank=per_rank, pairs_per_step_per_rank=per_rank,
                               forwards_per_step=1)


def _engine(args):
    from miles.rollout.engine import RolloutEngine
    from miles.rollout.types import SamplingParams

    return RolloutEngine(args.hf_checkpoint, SamplingParams.from_args(args), family=args.diffusion_model_family,
                         device="meta", dtype=args.rollout_dtype or "float32",
                         offload=getattr(args, "offload_rollout", False))


def _reward_workers(memory: LiveMemory, args, place: str) -> int:
    """The scorer each reward worker holds, built on meta from the committed table (PickScore)."""
    from miles.plan.memory_plan import _table_key
    from miles.plan.model_table import RELEASED

    if args.loss_type == "sft_loss" or args.rm_type != "pickscore" or not args.pickscore_model_path:
        return 0
    key = _table_key(args.pickscore_model_path)
    if key is None or key not in RELEASED:
        return 0
    spec = RELEASED[key]["components"]["model"]
    from miles.utils.dotted_path import load_callable

    cls = load_callable(f"{spec['library']}:{spec['class']}", "scorer class")
    config = load_callable(f"transformers:{spec['config_class']}", "scorer config")(**spec["config"])
    with memory.at(place, REWARD), torch.device("meta"):
        memory.scorer = cls(config).eval()  # the worker's fp32 CLIP (miles.rollout.rm_hub.pickscore)
    return 1


def conditioning_shapes(family: str, transformer, length: int | None) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{key: (shape, floating)} of one prompt's conditioning, as the family's `encode` returns it."""
    cfg = transformer.config
    if family == "qwen_image":
        n = length or 512
        return {"encoder_hidden_states": ((1, n, cfg.joint_attention_dim), True),
                "encoder_hidden_states_mask": ((1, n), False)}
    if family == "sd3":
        return {"encoder_hidden_states": ((1, 77 + (length or 256), cfg.joint_attention_dim), True),
                "pooled_projections": ((1, cfg.pooled_projection_dim), True)}
    if family == "wan2_2":
        return {"encoder_hidden_states": ((1, length or 512, cfg.text_dim), True)}
    if family == "cosmos3":
        return {"encoder_hidden_states": ((1, length or 512, cfg.text_embed_dim), True)}
    if family == "ltx":
        n = length or 128
        return {"encoder_hidden_states": ((1, n, cfg.caption_channels), True), "encoder_attention_mask": ((1, n), False)}
    if family == "ltx2":  # the connectors' outputs: the video and audio streams' text, one mask
        n = length or 1024
        return {"encoder_hidden_states": ((1, n, cfg.cross_attention_dim), True),
                "audio_encoder_hidden_states": ((1, n, cfg.audio_cross_attention_dim), True),
                "encoder_attention_mask": ((1, n), False)}
    raise ValueError(f"no conditioning shapes for family {family!r}")


def _conditioning(model, args, dtype: torch.dtype):
    from miles.rollout.types import Conditioning

    transformer = next(iter(model.transformers.values()))
    shapes = conditioning_shapes(model.family, transformer, getattr(args, "diffusion_max_sequence_length", None))
    make = lambda: {k: torch.empty(s, dtype=dtype if f else torch.long, device="meta")  # noqa: E731
                    for k, (s, f) in shapes.items()}
    return Conditioning(make(), make() if model.spec.guided else None)


def _rollout_step(memory: LiveMemory, args, engine) -> None:
    """One denoising step and one decode, as `sampler._denoise` runs them, plus the microgroup's
    trajectories (every step's latents, and model outputs in debug mode) on the host."""
    from miles.rollout import sampler
    from miles.rollout.engine_offload import resident_while_sampling

    model, params = engine.model, engine.params
    shape = model.latent_shape(params.height, params.width, params.num_frames)
    group = params.microgroup_size or args.n_samples_per_prompt
    steps = params.num_steps
    with resident_while_sampling(engine.offloaded_weights):
        with memory.at(HOST, ENGINE):
            # the microgroup's path as sampler._denoise holds it at its peak: every step's latents (and
            # model outputs) as made, and their stack
            stored = (steps + 1) + (steps if args.diffusion_debug_mode else 0)
            made = [torch.empty((group, *shape), dtype=torch.float32, device="meta") for _ in range(stored)]
            held = torch.stack(made, dim=1)
            cond = _conditioning(model, args, model.dtype)
            x = torch.empty((1, *shape), dtype=torch.float32, device="meta")
        sigmas = sampler.sigmas_for(model, params)
        expert = model.expert_for_step(sigmas, 0)
        scale = sampler.guidance_scales(model, params)[expert]
        with torch.no_grad():
            v = model.velocity(x, sigmas[0], cond, scale, expert).cpu()
            images = model.decode(model.pipeline_latents(x, sigmas[-1]))
        del v, images, cond, x
    del held, made  # what generate returns (references to the object store) outlives the weights' offload


def _batches(args, rank, real_plan):
    """The batches of the train phase (one per trained expert, see below), and the shard's other
    trajectories (held once)."""
    _, order = _train_order(args, rank)
    out = [_batch(args, rank, real_plan, expert, hold=i == 0) for i, expert in enumerate(order)]
    return [b for b, _ in out], out[0][1]


def _train_order(args, rank) -> tuple[list[str], list[str]]:
    """Each denoising step's expert, and the experts the train phase steps, in order: every trained
    expert once (each one's AdamW state exists after its first step), then the first again: the
    steady state, every state present while a step runs."""
    model = rank.fmodel
    params = _sampling(args)
    sigmas = model.sigmas(params.num_steps, params.shift, params.height, params.width, params.num_frames)
    experts = [model.expert_for_step(sigmas, k) for k in range(params.num_steps)]
    trained = [e for e in dict.fromkeys(experts) if e in rank.components]
    return experts, (trained + trained[:1] if len(trained) > 1 else trained)


def _sft_batches(args, rank) -> list:
    """SFT's batches of the train phase: per trained expert, the plan's items at a window of steps
    that expert owns (stand-in media, miles.replay.seams), each item its own media file."""
    from miles.backends.sft import SFTBatch
    from miles.backends.sft_data import SFTItem

    plan, params = rank.plan, _sampling(args)
    experts, order = _train_order(args, rank)
    n = args.n_samples_per_prompt
    items = [SFTItem(f"prompt {i}", f"item-{i}.png", params.height, params.width, params.num_frames, i)
             for i in range(math.ceil(plan.samples_per_rollout / n))]
    batches = []
    for expert in order:
        first = _trained_step(plan, experts, expert)
        batches.append(SFTBatch(0, items, n, list(range(first, first + plan.num_trained_steps))))
    return batches


def _sampling(args):
    from miles.rollout.types import SamplingParams

    return SamplingParams.from_args(args)


def _batch(args, rank, real_plan, expert: str, hold: bool):
    """A rollout batch dealing rank 0 its one micro-batch, and the rest of the shard the real plan
    deals it (held beside, never read): its trajectories on the host, as the rank fetches them from
    the object store (miles.backends.rollout_shard: every other trajectory is None)."""
    from miles.backends.rollout_shard import probed_outputs
    from miles.backends.types import RolloutBatch
    from miles.rollout.types import Trajectory
    from miles.rollout.sampler import guidance_scales
    from miles.rollout.types import SamplingParams
    from miles.flags.batching import expand_pairs, shard_pairs

    plan = rank.plan
    model = rank.fmodel
    params = SamplingParams.from_args(args)
    steps = params.num_steps
    sigmas = model.sigmas(steps, params.shift, params.height, params.width, params.num_frames)
    shape = model.latent_shape(params.height, params.width, params.num_frames)
    experts = [model.expert_for_step(sigmas, k) for k in range(steps)]
    scales = guidance_scales(model, params)
    first = _trained_step(plan, experts, expert)
    trained = list(range(first, first + plan.num_trained_steps))
    mine = {p.sample for p in shard_pairs(expand_pairs(plan.samples_per_rollout, trained), plan.dp_size, 0,
                                          plan.dp_split_mode)}
    dtype = getattr(torch, args.rollout_dtype or "float32")
    image = (3, params.height, params.width) if params.num_frames <= 1 else (
        params.num_frames, 3, params.height, params.width)  # the decoded sample, float32 (sampler._denoise)

    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.device("cpu"):  # real values: the rank reads them (tolist)
        host_sigmas = torch.tensor(sigmas, dtype=torch.float32)

    outputs = probed_outputs(args, plan, trained)
    conds: dict[int, object] = {}

    def trajectory(i: int) -> Trajectory:
        """As the rank fetches it: what the engine kept (`for_training`), its group's conditioning shared."""
        meta = lambda *s: torch.empty(s, dtype=torch.float32, device="meta")  # noqa: E731
        group = i // args.n_samples_per_prompt
        whole = Trajectory(prompt="", group_index=group, sample_index=i, seed=i,
                           latents=meta(steps + 1, *shape), sigmas=host_sigmas.clone(),
                           log_probs=meta(steps), trained_steps=trained, cond=None,
                           experts=experts, guidance_scales=[scales[e] for e in experts], sde_type="sde",
                           noise_level=params.noise_level, image=meta(*image),
                           model_outputs=meta(steps, *shape) if args.diffusion_debug_mode else None)
        kept = whole.for_training(outputs.get(i, ()))
        kept.cond = conds.setdefault(group, _conditioning(model, args, dtype))
        return kept

    trajectories = [trajectory(i) if i in mine else None for i in range(plan.samples_per_rollout)]
    n = plan.samples_per_rollout
    real = len({p.sample for p in shard_pairs(expand_pairs(real_plan.samples_per_rollout, range(
        real_plan.num_trained_steps)), real_plan.dp_size, 0, real_plan.dp_split_mode)})
    held = [trajectory(i) for i in range(max(0, real - len(mine)))] if hold else []
    return RolloutBatch(0, trajectories, [0.0] * n, [1.0 if i % 2 else -1.0 for i in range(n)], trained), held


def _trained_step(plan, experts: list[str], expert: str) -> int:
    """The first step the plan may train whose window of trained steps stays on `expert`."""
    n = plan.num_trained_steps
    steps = [s for s in plan.trainable_steps if s + n <= len(experts) and set(experts[s:s + n]) == {expert}]
    steps = steps or [s for s in range(len(experts) - n + 1) if set(experts[s:s + n]) == {expert}]
    return steps[0]


def _name(memory: LiveMemory, rank, engine) -> None:
    named: dict[str, torch.Tensor] = {}
    for who, model in (("train rank", getattr(rank, "model", None)), ("train rank compute copy",
                                                                      getattr(rank, "fmodel", None)),
                       ("engine", getattr(engine, "model", None))):
        if model is None:
            continue
        for part, module in model.parts.items():
            if isinstance(module, torch.nn.Module):
                for n, p in module.named_parameters():
                    named[f"{who} {part}.{n}"] = p
                    if p.grad is not None:
                        named[f"{who} {part}.{n}.grad"] = p.grad
                for n, b in module.named_buffers():
                    named[f"{who} {part}.{n}"] = b
    optimizer = getattr(rank, "optimizer", None)
    if optimizer is not None:
        names = {id(p): n for n, p in rank.params.items()}
        for p, state in optimizer.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    named[f"train rank AdamW {k} of {names.get(id(p), '?')}"] = v
    memory.name_storages(named)


def _processes(args, places: dict[str, str], engines: bool, rewards: int) -> dict[str, dict[str, int]]:
    from miles.flags.validation import train_gpus

    out: dict[str, dict[str, int]] = {TRAIN_GPU: {RANK: 1}}
    if engines:
        out.setdefault(places[ENGINE], {})[ENGINE] = 1
    if rewards:
        if args.colocate_reward:
            per_gpu = math.ceil(args.rm_num_workers / max(1, train_gpus(args)))
        else:
            per_gpu = min(args.rm_num_workers, max(1, int(1 / args.rm_num_gpus_per_worker + 1e-9)))
        out.setdefault(places[REWARD], {})[REWARD] = per_gpu
    return out


def _measures(records: list[PhaseRecord], processes: dict[str, dict[str, int]], top) -> list[PhaseMeasure]:
    out = []
    for record in records:
        for place, roles in processes.items():
            shares = {r: record.role_share(place, r) * n for r, n in roles.items()}
            out.append(PhaseMeasure(record.name, place, sum(shares.values()), shares, top(record, place)))
    return out


def _top(memory: LiveMemory, record: PhaseRecord, place: str) -> list[str]:
    allocs = [item for key, items in record.top.items() if key[0] == place for item in items]
    seen, lines = set(), []
    for k, a, nbytes in sorted(allocs, key=lambda item: -item[2]):
        if k not in seen:
            seen.add(k)
            lines.append(f"{a.role}: {memory.describe(a, nbytes)}")
    return lines[:6]


def process_host(records: list[PhaseRecord]) -> dict[str, dict[str, int]]:
    """Per phase, the host memory of one train rank and of one engine, and of a rank that writes no
    file in the phase (a data-parallel checkpoint is rank 0's alone; the replayed rank is rank 0)."""
    return {record.name: {RANK: record.role_share(HOST, RANK), ENGINE: record.role_share(HOST, ENGINE),
                          "idle rank": record.start.get((HOST, RANK), 0)} for record in records}


def offload_layout(rank, engine) -> dict[str, tuple[int, int]]:
    """Each offloaded part's host arena and what torch's pinned allocator would hold for the same
    storages (each rounded up to a power of two): miles.models.offload."""
    parts = []
    if getattr(rank, "offload", None) is not None:
        parts += [(f"{RANK} {p.what.split(' ', 3)[-1]}", p) for p, _ in rank.offload.parts()]
    if engine is not None and engine.offloaded_weights is not None:
        parts.append((f"{ENGINE} weights", engine.offloaded_weights.weights))
    return {name: (part.arena.nbytes if part.arena is not None else 0, part.rounded_bytes) for name, part in parts}
