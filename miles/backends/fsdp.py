"""`--train-backend fsdp`: each trained transformer sharded with FSDP2 across the train ranks.

Units. One `fully_shard` unit per transformer block (every block of each `*blocks` ModuleList of
the transformer) plus the transformer itself as the root unit (embeddings, norms, projections).
Every unit reshards after its forward (the root too), so between forwards a rank holds 1 / ranks
of each trained weight plus at most one all-gathered unit.

Dtypes. The sharded parameters are the master weights, in --param-dtype (under LoRA with a
float32 master, the frozen base is in the compute dtype instead: miles.backends.sharded_load's
`frozen_base_to`; its all-gather then casts nothing, and gathers the same bits). The mixed-precision
policy all-gathers them cast to --compute-dtype (an elementwise cast of each shard, so the
gathered weight is exactly the master rounded to the compute dtype, which is what an engine
holds after it receives the weight in --rollout-dtype == --compute-dtype) and reduce-scatters
the gradients in the param dtype. What FSDP does not cast is cast once here: the transformer's
floating buffers and every part that is not trained (VAE, text encoders, an untrained expert) go
to the compute dtype, as the engine loaded them; forward inputs are cast by the model's own
`velocity` (its `dtype` becomes the compute dtype), never by FSDP, so they take the engine's path.
So there is no second copy of the model in the compute dtype, and the parity probe stays exact.

Gradients. Each micro-batch's backward reduce-scatters its gradients into the sharded gradient
(summed in the param dtype, divided by the rank count), so a rank never holds a full gradient.
The data-parallel backend instead sums a rank's micro-batches first and all-reduces once, so the
two differ by float rounding order (tests/unit/backends/test_fsdp.py states the tolerance).

Checkpoints: `torch.distributed.checkpoint` (DCP) files written by every rank into the staging
directory, plus `rank0.json` (backend, rank count, optimizer step). DCP stores global shapes, so
a checkpoint saved by N ranks loads on any rank count (resharded on load); a data-parallel
checkpoint is refused under fsdp and the other way round, naming `--train-backend`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from miles.models.precision import BUFFER, cast_to_rule, held_dtype, is_kept_in_float32, kept_modules


BACKEND = "fsdp"
MANIFEST = "rank0.json"


class CheckpointBackendError(ValueError):
    """A checkpoint written by the other train backend."""


def device_mesh(device: torch.device, world_size: int, replicas: int = 1):
    """One dimension that shards over every rank; with `replicas` > 1 (--dp-replicate-size) a 2-D
    mesh, replicas x ranks per replica: FSDP2 shards within a replica and all-reduces across
    replicas (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return init_device_mesh(device.type, (world_size,))
    return init_device_mesh(device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a diffusers transformer: the items of its `*blocks` ModuleLists."""
    blocks = [block for name, child in module.named_children()
              if isinstance(child, torch.nn.ModuleList) and name.endswith("blocks") for block in child]
    if not blocks:
        raise ValueError(f"--train-backend fsdp: {type(module).__name__} has no ModuleList of blocks "
                         f"(no child named '*blocks'); use --train-backend dp")
    return blocks


def mixed_precision(param_dtype: torch.dtype, compute_dtype: torch.dtype, reduce_dtype: torch.dtype | None = None):
    """Gathered in the compute dtype; gradients reduced in `reduce_dtype` (--fsdp-reduce-dtype, unset:
    the param dtype) and kept in the param dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype or param_dtype, output_dtype=None,
                                cast_forward_inputs=False)


def shard_model(model, components: list[str], mesh, param_dtype: torch.dtype, compute_dtype: torch.dtype,
                reduce_dtype: torch.dtype | None = None) -> None:
    """Shard the trained components in place; everything not trained goes to the compute dtype."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(param_dtype, compute_dtype, reduce_dtype)
    for component in components:
        module = model.transformers[component]
        for block in transformer_blocks(module):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        keep_rule_dtypes(module, compute_dtype, reduce_dtype or param_dtype)
        if compute_dtype != param_dtype:
            _cast_buffers(module, compute_dtype)
    trained = {id(model.transformers[c]) for c in components}
    for part in model.parts.values():
        if isinstance(part, torch.nn.Module) and id(part) not in trained and compute_dtype != param_dtype:
            if part in model.transformers.values():
                cast_to_rule(part, compute_dtype)  # an untrained expert: as an engine's from_pretrained holds it
            else:
                # the VAE and (SFT) text encoders as before: UMT5 keeps its `wo` in float32 under from_pretrained,
                # +1.9 GiB on sft_wan22's full run that the memory plan does not count yet (issue 39, point 6)
                part.to(dtype=compute_dtype)
    model.dtype = compute_dtype  # velocity() casts the latents to this, as an engine does


@torch.no_grad()
def _cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Each floating buffer to the dtype the rule holds it in (a kept module's stay float32)."""
    keep = kept_modules(module)
    for sub_name, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.is_floating_point():
                qualified = f"{sub_name}.{name}" if sub_name else name
                sub._buffers[name] = buf.to(held_dtype(keep, qualified, BUFFER, buf.dtype, dtype))


def keep_rule_dtypes(module: torch.nn.Module, compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """Gather each parameter in the dtype miles.models.precision holds it in: a module the class keeps in
    float32 is gathered uncast, as the engine holds it. FSDP2 takes one policy per unit and Wan2.2
    keeps bare parameters of a block (`scale_shift_table`), so the policy is overridden per parameter
    after FSDP sets it (its lazy init), and the unit's gradients are brought to the reduce dtype
    before its reduce-scatter, which wants one dtype (the cast it would apply anyway)."""
    keep = kept_modules(module)
    if not keep or compute_dtype == torch.float32:
        return
    if reduce_dtype != torch.float32:
        raise ValueError(f"--fsdp-reduce-dtype {str(reduce_dtype).removeprefix('torch.')}: {type(module).__name__} "
                         f"keeps modules in float32 ({', '.join(keep)}), whose gradients are float32; "
                         f"fix: --fsdp-reduce-dtype float32")
    names = {id(m): n for n, m in module.named_modules()}
    for sub in module.modules():
        state = sub._get_fsdp_state() if hasattr(sub, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        if group is not None:
            _override_group(group, keep, names)


def _qualified(fsdp_param, names: dict[int, str]) -> str:
    info = fsdp_param._module_info
    owner = names.get(id(info.module), "")
    return f"{owner}.{info.param_name}" if owner else info.param_name


def _override_group(group, keep: tuple[str, ...], names: dict[int, str]) -> None:
    kept = [p for p in group.fsdp_params if is_kept_in_float32(keep, _qualified(p, names))]
    if not kept:
        return
    init_mp_dtypes, post_backward = group._init_mp_dtypes, group.post_backward

    def init_with_kept_float32() -> None:
        init_mp_dtypes()
        for fsdp_param in kept:
            fsdp_param.param_dtype = None  # gathered as the master holds it: float32

    def post_backward_in_reduce_dtype(*unused):
        for fsdp_param in group.fsdp_params:
            if hasattr(fsdp_param, "_unsharded_param") and fsdp_param.unsharded_accumulated_grad is None:
                fsdp_param.to_accumulated_grad_if_needed()
        return post_backward(*unused)

    group._init_mp_dtypes, group.post_backward = init_with_kept_float32, post_backward_in_reduce_dtype


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip sharded gradients in place by their global norm; returns the norm before clipping, a
    0-dim float64 tensor on the device (read once, with the step's metrics).

    The norm is summed from each rank's local shards (their squares, in float64) and all-reduced:
    every element counted once whatever the sharding, the same total on every rank. Nothing is read
    back to the host: the clip factor min(1, max_norm / (norm + 1e-6)) multiplies every gradient
    (a factor of exactly 1 changes no bit)."""
    sharded = [p.grad for p in params if p.grad is not None]
    if not sharded:
        return torch.zeros((), dtype=torch.float64)
    grads = [_local(g) for g in sharded]
    local_sq = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        local_sq += g.double().pow(2).sum()
    local_sq /= _replicas_holding(sharded[0])  # HSDP: each replica holds the same shards
    if dist.is_initialized():
        dist.all_reduce(local_sq)
    norm = local_sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            _scale(g, coef)
    return norm


def _scale(grad: torch.Tensor, coef: torch.Tensor) -> None:
    """grad *= coef as `mul_` by a Python scalar computes it: in the dtype's op math (float32 for
    the 16-bit dtypes), the factor rounded to that, the product rounded once to the gradient's dtype."""
    opmath = torch.promote_types(grad.dtype, torch.float32)
    if grad.dtype == opmath:
        grad.mul_(coef.to(opmath))
    else:
        grad.copy_(grad.to(opmath).mul_(coef.to(opmath)))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _replicas_holding(tensor: torch.Tensor) -> int:
    """How many ranks hold each element of a sharded tensor: the mesh dimensions it is replicated over."""
    placements = getattr(tensor, "placements", ())
    mesh = getattr(tensor, "device_mesh", None)
    count = 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            count *= mesh.size(dim)
    return count


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded parameter (a collective: every rank must call it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def check_same_expert_sequence(experts: list[str], world_size: int) -> None:
    """Every rank must run its units' forwards in the same order (each forward all-gathers):
    refuse a schedule whose micro-batches hit the experts in a different order on some rank."""
    if world_size == 1:
        return
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, experts)
    if any(g != gathered[0] for g in gathered):
        raise RuntimeError(f"--train-backend fsdp: the ranks' micro-batches use the experts in different orders "
                           f"({[g[:6] for g in gathered]}...), so their all-gathers would not match; use "
                           f"--train-backend dp for this batch layout")


# -- checkpoints ------------------------------------------------------------------------------------

def _container(model, components: list[str]) -> torch.nn.ModuleDict:
    """The trained components under one module, so parameter names are `<component>.<name>`."""
    return torch.nn.ModuleDict({c: model.transformers[c] for c in components})


def _state(model, components, params, optimizer, ema) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"params": {n: p.detach() for n, p in params.items()},
             "optimizer": get_optimizer_state_dict(_container(model, components), optimizer)}
    if ema is not None:
        state["ema"] = ema.shadow
    return state


def save_sharded_async(staging: Path, rank: int, world_size: int, model, components, params, optimizer, ema,
                       optimizer_step: int, lora: bool, group):
    """DCP's asynchronous save: every local shard is copied to the host before this returns, the
    files are written by a thread (collectives on `group`, a gloo group of its own). Returns its
    future; the checkpoint is whole once every rank's future is done (DCP writes its .metadata last)."""
    import torch.distributed.checkpoint as dcp

    future = dcp.async_save(_state(model, components, params, optimizer, ema), checkpoint_id=str(staging),
                            process_group=group)
    if rank == 0:
        manifest = {"backend": BACKEND, "world_size": world_size, "lora": lora, "optimizer_step": optimizer_step}
        (staging / MANIFEST).write_text(json.dumps(manifest))
    return future


def read_manifest(path: Path) -> dict:
    manifest = path / MANIFEST
    return json.loads(manifest.read_text()) if manifest.exists() else {}


def check_backend(path: Path, backend: str) -> dict:
    """The checkpoint's manifest, or CheckpointBackendError if another train backend wrote it."""
    manifest = read_manifest(path)
    saved = manifest.get("backend", "dp")
    if saved != backend:
        raise CheckpointBackendError(
            f"checkpoint {path} was saved by --train-backend {saved} ({manifest.get('world_size', '?')} ranks), "
            f"this run uses --train-backend {backend}; the two layouts differ (fsdp: sharded DCP files, dp: whole "
            f"safetensors); fix: resume with --train-backend {saved}")
    return manifest


@torch.no_grad()
def load_sharded(path: Path, model, components, params, optimizer, ema) -> int:
    """Load in place (resharded to this run's rank count); returns the optimizer step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    manifest = check_backend(path, BACKEND)
    state = _state(model, components, params, optimizer, ema)
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(_container(model, components), optimizer, state["optimizer"])
    return int(manifest["optimizer_step"])
