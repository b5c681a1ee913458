"""One dtype rule (miles.models.precision): for every family's transformer at tiny size, LoRA and full
fine-tune, the engine holds, the trainer computes in (the data-parallel compute copy and FSDP2's
gathered weights) and the push sends each tensor in the dtype the rule gives it, tensor by tensor.

Each side is observed where it acts: the engine's tensors after it loaded (and attached LoRA); the
trainer's tensors as each module's forward sees them (FSDP2 gathers them only there); the push's
bucket plan and object-store copies. Wan2.2 is the family that keeps modules in float32: before the
rule, its FSDP2 forward saw them in bfloat16 and its push sent them in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from miles.backends import fsdp
from miles.backends.lora import LoraSpec
from miles.backends.sharded_load import attach_lora_on_meta, frozen_base_to, materialize_from_checkpoint
from miles.backends.weight_buckets import plan_buckets
from miles.backends.weight_sync import collect_weight_updates, synced_tensors, wire_rule
from miles.models.loader import load_model
from miles.models.precision import tensor_dtypes
from miles.diffusion_facts.families import FAMILY_NAMES

COMPUTE = torch.bfloat16


def _lora(model) -> LoraSpec:
    return LoraSpec(rank=2, alpha=4, target_modules=tuple(model.spec.lora_target_modules))


def _held(module) -> dict[str, torch.dtype]:
    return {**{n: p.dtype for n, p in module.named_parameters()}, **{n: b.dtype for n, b in module.named_buffers()}}


def _differences(seen: dict[str, torch.dtype], rule: dict[str, torch.dtype]) -> list[str]:
    return [f"{n}: {seen[n]} (rule: {rule[n]})" for n in sorted(seen) if seen[n] != rule[n]]


def _forward_dtypes(model, component: str) -> dict[str, torch.dtype]:
    """Each parameter's and buffer's dtype as its own module's forward sees it (after FSDP gathered it)."""
    module = model.transformers[component]
    seen: dict[str, torch.dtype] = {}

    def record(prefix):
        def hook(sub, _args):
            for name, t in [*sub._parameters.items(), *sub._buffers.items()]:
                if t is not None:
                    seen[f"{prefix}{name}"] = t.dtype
        return hook

    handles = [sub.register_forward_pre_hook(record(f"{n}." if n else "")) for n, sub in module.named_modules()]
    try:
        g = torch.Generator().manual_seed(0)
        cond = model.encode_prompts(["a red cat"], "blurry")
        x = torch.randn(1, *model.latent_shape(32, 32, 5), generator=g)
        with torch.no_grad():
            model.velocity(x, torch.tensor([0.5]), cond, 4.0, component)
    finally:
        for h in handles:
            h.remove()
    return seen


def _rule(module) -> dict[str, torch.dtype]:
    return {n.replace("base_model.model.", ""): d for n, d in tensor_dtypes(module, COMPUTE).items()}


def _engine(checkpoint, lora: bool):
    """What a rollout engine holds: the loader in the rollout dtype, LoRA attached as an engine attaches it."""
    model = load_model(checkpoint, dtype=COMPUTE)
    if lora:
        spec = _lora(model)
        model.apply_lora(spec.rank, spec.alpha, list(spec.target_modules))
    return model


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp_trainer(checkpoint, lora: bool):
    """The sharded trainer's model as TrainRank builds it under --train-backend fsdp with a float32
    master: trained transformers built on meta, adapters attached there, the frozen base in the
    compute dtype, sharded, then filled from the files."""
    probe = load_model(checkpoint, dtype=COMPUTE, device="meta")
    components = list(probe.spec.transformer_components)
    model = load_model(checkpoint, dtype=COMPUTE, empty=dict.fromkeys(components, torch.float32))
    values = {}
    for c in components:
        module = model.transformers[c]
        if lora:
            values[c] = attach_lora_on_meta(module, _lora(model))
            frozen_base_to(module, COMPUTE)
        else:
            module.requires_grad_(True)
    fsdp.shard_model(model, components, fsdp.device_mesh(torch.device("cpu"), 1), torch.float32, COMPUTE)
    for c in components:
        materialize_from_checkpoint(model.transformers[c], checkpoint / c, torch.device("cpu"), values.get(c))
    return model, components


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_engine_trainer_and_push_hold_every_tensor_in_the_rules_dtype(family, lora, tiny_checkpoint, one_rank_group):
    checkpoint = tiny_checkpoint(family)
    engine = _engine(checkpoint, lora)
    components = list(engine.spec.transformer_components)
    problems = []
    for c in components:
        rule = _rule(engine.transformers[c])
        problems += [f"engine {c}.{d}" for d in _differences(_held(engine.transformers[c]), rule)]
        # the data-parallel compute copy is loaded and given LoRA by the engine's own loader; its forward:
        problems += [f"dp trainer {c}.{d}" for d in _differences(_forward_dtypes(engine, c), rule)]
    sharded, _ = _fsdp_trainer(checkpoint, lora)
    for c in components:
        rule = _rule(engine.transformers[c])
        problems += [f"fsdp trainer {c}.{d}" for d in _differences(_forward_dtypes(sharded, c), rule)]

    engine_dtypes = {(c, n): t.dtype for c in components for n, t in engine.transformers[c].named_parameters()}
    tensors = synced_tensors(sharded.transformers, components, lora_only=lora)
    plan = plan_buckets(tensors, wire_rule(sharded.transformers, COMPUTE), 1 << 20)
    for bucket in plan.buckets:
        problems += [f"push bucket {s.component}.{s.name}: {bucket.dtype} (engine: {engine_dtypes[(s.component, s.name)]})"
                     for s in bucket.slots if getattr(torch, bucket.dtype) != engine_dtypes[(s.component, s.name)]]
    updates = collect_weight_updates(sharded.transformers, components, lora, to_host=lambda t: fsdp.full_tensor(t).cpu(),
                                     wire=wire_rule(sharded.transformers, COMPUTE))
    problems += [f"push object store {u.component}.{n}: {t.dtype} (engine: {engine_dtypes[(u.component, n)]})"
                 for u in updates for n, t in u.state_dict.items() if t.dtype != engine_dtypes[(u.component, n)]]
    assert not problems, f"{len(problems)} tensors off the rule:\n" + "\n".join(problems[:40])
