"""One data-parallel train rank: the pairs the batch plan deals it, the loss, the optimizer step.

A plain class so a benchmark or a test can drive it in process; `miles.ray.train_actor_group`
runs it as a Ray actor. Ranks meet through one `torch.distributed` group built the same way on
every device (`miles.backends.collectives`: gloo on CPU, gloo for CPU tensors + NCCL for CUDA
tensors on GPU) and average gradients with one all-reduce per optimizer step.

Dtypes (`--param-dtype`, `--compute-dtype`, `--rollout-dtype`). The optimizer holds the master
weights in the param dtype (`self.model`, `self.params`). When the compute dtype differs, a
second copy of the model is loaded in the compute dtype by the same loader the engines use
(`self.fmodel`, `self.fparams`): every train forward, the parity probe and the KL reference run
on it, backward leaves its gradients there, they are cast to the param dtype for the all-reduce
and the step, and the new master weights are cast back into it (the cast an engine applies when
it receives them). The validator makes the compute dtype the rollout dtype whenever engines run,
so this copy and an engine hold the same weights in the same dtypes and compute the same
forward: that is what keeps the parity probe at exactly 0.0 under bf16. When the two dtypes are
equal there is no copy (`fmodel is model`), and the step is the same sequence of ops as before.

`--train-backend fsdp` shards the trained components instead (miles.backends.fsdp: no compute copy,
gradients reduce-scattered in backward); `--offload-train` keeps the rank's state on the host
outside its calls (miles.backends.train_offload).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch

from miles.backends import checkpoint as ckpt
from miles.backends import checkpoint_writer
from miles.backends.collectives import Collectives, host_store
from miles.backends import fsdp
from miles.backends.ema import EMA, old_policy_decay
from miles.backends.loss import load_custom_loss
from miles.backends.lora import LoraSpec, attach_lora, lora_spec_from_args
from miles.backends.optimizer import build_optimizer
from miles.backends.train_offload import TrainOffload, resident
from miles.backends.sft import SFTRankStep
from miles.backends.weight_sync import WeightUpdate, collect_weight_updates, sync_components, synced_tensors, wire_rule
from miles.records import phases
from miles.rollout.sampler import expert_phases
from miles.rollout.types import SamplingParams
from miles.flags.batch_rules import ConfigError, high_noise_step_count
from miles.backends.train_step import RolloutTrainStep

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def torch_dtype(name: str | None) -> torch.dtype:
    return getattr(torch, name or "float32")


class TrainRank(RolloutTrainStep):
    def __init__(self, args, plan, rank: int, world_size: int):
        phases.actor_init(f"train rank {rank}")
        self.args, self.plan = args, plan
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda" if args.device == "cuda" else "cpu")
        self.optimizer_step = 0
        self.group_store = None  # rank 0's, once master_address() has been asked

    # -- start-up -----------------------------------------------------------------------------

    def master_address(self) -> tuple[str, int]:
        """Rank 0: this node's address and the port of the process group's store, which it hosts
        from now on (the other ranks connect to it as they set up)."""
        import ray

        host = ray.util.get_node_ip_address()
        self.group_store = host_store(host)
        return host, self.group_store.port

    def setup(self, master_addr: str | None = None, master_port: int | None = None) -> None:
        from miles.backends.sharded_load import attach_lora_on_meta, frozen_base_to, materialize_from_checkpoint
        from miles.models.runtime import actor_threads, configure_torch

        args = self.args
        configure_torch(args.deterministic_mode, actor_threads(self.device.type))
        seed_everything(args.seed)  # the same on every rank: LoRA adapters start identical
        self.comm = Collectives(self.device, self.world_size)
        self.comm.init_process_group(self.rank, master_addr, master_port, always=self.sharded,
                                     store=self.group_store)
        param_dtype, compute_dtype = torch_dtype(args.param_dtype), torch_dtype(args.compute_dtype)
        self._load_models(param_dtype, compute_dtype)
        self._check_expert_phases()
        self.components = sync_components(self.model.spec.transformer_components, args.update_weight_target_module)
        self.lora: LoraSpec | None = lora_spec_from_args(args, self.model.spec)
        lora_values: dict[str, dict[str, torch.Tensor]] = {}
        for component in self.components:
            module = self.model.transformers[component]
            if self.lora is not None and self.meta_built:
                lora_values[component] = attach_lora_on_meta(module, self.lora)
                frozen_base_to(module, compute_dtype)  # only the adapters need a --param-dtype master
            elif self.lora is not None:
                attach_lora(module, self.lora)
            else:
                module.requires_grad_(True)
        self.params = self._trained_params()
        self.fparams = self.params if self.fmodel is self.model else self._compute_params()
        if args.gradient_checkpointing:
            for component in self.components:
                enable_gradient_checkpointing(self.fmodel.transformers[component], self.model.family, component)
        if self.world_size > 1 and not self.meta_built:  # meta-built: every rank reads the same files
            for p in self.params.values():
                self.comm.broadcast(p.data, src=0)
        if self.sharded:  # after the adapters are in and every rank holds the same weights
            fsdp.shard_model(self.model, self.components,
                             fsdp.device_mesh(self.device, self.world_size, getattr(args, "dp_replicate_size", 1)),
                             param_dtype, compute_dtype,
                             torch_dtype(getattr(args, "fsdp_reduce_dtype", None) or args.param_dtype))
            for component in self.components if self.meta_built else ():
                materialize_from_checkpoint(self.model.transformers[component], self.model.path / component,
                                            self.device, lora_values.get(component))
            self.params = self.fparams = self._trained_params()  # sharding made new (DTensor) parameters
        self._sync_compute()
        self.optimizer = build_optimizer(list(self.params.items()), args)
        self.ema = EMA(self.params, args.ema_decay) if args.use_ema else None
        self.custom_loss = load_custom_loss(args.custom_loss_function_path) if args.custom_loss_function_path else None
        self.sft = SFTRankStep(self) if args.loss_type == "sft_loss" else None
        self.offload = TrainOffload(self) if getattr(args, "offload_train", False) else None
        if self.offload is not None:
            self.offload.offload()  # the engines sample first
        phases.actor_ready(f"train rank {self.rank}")

    def _load_models(self, param_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        """The master model (`self.model`) and the one forwards run on (`self.fmodel`), each loaded
        straight into its final dtype, with no part it never reads: the text encoders only where
        SFT encodes prompts (on the forward model). Sharded (fsdp, float32 master), the trained
        transformers are built on meta and each rank later reads only its own rows
        (miles.backends.sharded_load; under LoRA their frozen base in the compute dtype); every
        other part is loaded in the compute dtype, as an engine loads it in the rollout dtype."""
        from miles.models.loader import TEXT_PARTS, load_model
        from miles.models.registry import detect_family, get_family

        args = self.args
        sft = args.loss_type == "sft_loss"
        load = lambda dtype, **kw: load_model(args.hf_checkpoint, family=args.diffusion_model_family,  # noqa: E731
                                              device=self.device, dtype=dtype, **kw)
        self.meta_built = self.sharded and param_dtype == torch.float32
        if self.meta_built:
            spec = get_family(args.diffusion_model_family or detect_family(Path(args.hf_checkpoint)))
            trained = sync_components(spec.transformer_components, args.update_weight_target_module)
            self.model = self.fmodel = load(compute_dtype, skip=() if sft else TEXT_PARTS,
                                            empty=dict.fromkeys(trained, param_dtype))
            return
        # fsdp: the master model, whose all-gathers cast to the compute dtype (miles.backends.fsdp)
        same = compute_dtype == param_dtype or self.sharded
        self.model = load(param_dtype, skip=() if sft and same else TEXT_PARTS)
        self.fmodel = self.model if same else load(compute_dtype, skip=() if sft else TEXT_PARTS)

    @property
    def sharded(self) -> bool:
        return getattr(self.args, "train_backend", "dp") == fsdp.BACKEND

    def _trained_params(self) -> dict[str, torch.nn.Parameter]:
        return {f"{c}.{n}": p for c in self.components
                for n, p in self.model.transformers[c].named_parameters() if p.requires_grad}

    def _check_expert_phases(self) -> None:
        """The plan kept each micro-batch on one expert using the family's default schedule, since
        validation opens no checkpoint; the checkpoint's scheduler config decides what the engines
        run. Where the two put the expert boundary at different steps, stop before training."""
        planned = tuple(self.plan.experts)
        if not planned:
            return
        actual = expert_phases(self.model, SamplingParams.from_args(self.args))
        if actual != planned:
            raise ConfigError(
                f"{self.args.hf_checkpoint}: its scheduler config puts the expert boundary after step "
                f"{high_noise_step_count(actual)} of {len(actual)}, the batch plan (the {self.model.family} default "
                f"shift) after step {high_noise_step_count(planned)}; fix: pass --diffusion-shift with the "
                f"checkpoint's shift so the plan and the engines use one schedule")

    def _compute_params(self) -> dict[str, torch.nn.Parameter]:
        """The compute copy's trained tensors, by the master's names; LoRA attached as an engine attaches it."""
        if self.lora is not None:
            self.fmodel.apply_lora(self.lora.rank, self.lora.alpha, list(self.lora.target_modules), self.components)
        fparams = {}
        for component in self.components:
            named = dict(self.fmodel.transformers[component].named_parameters())
            for name in [n for n in self.params if n.startswith(component + ".")]:
                fparams[name] = named[name[len(component) + 1:]]
                fparams[name].requires_grad_(True)
        return fparams

    @torch.no_grad()
    def _sync_compute(self, source: dict[str, torch.Tensor] | None = None) -> None:
        """Cast the master weights (or `source`, e.g. the EMA) into the compute copy."""
        if self.fparams is self.params:
            return
        source = source or self.params
        for name, fp in self.fparams.items():
            fp.copy_(source[name])

    def lora_spec(self) -> LoraSpec | None:
        return self.lora

    # -- DiffusionNFT's old policy (--ema-rollout-policy ema) ---------------------------------

    @property
    def old_policy(self) -> EMA | None:
        """The weights the engines sample with, a ramped EMA of the trained ones; made from the
        weights the first rollout was sampled with (the start-up weights or a loaded checkpoint's)."""
        if getattr(self.args, "ema_rollout_policy", "live") != "ema":
            return None
        if getattr(self, "_old_policy", None) is None:
            self._old_policy = EMA(self.params, 0.0)
        return self._old_policy

    def _rollout_policy_weights(self):
        """Context: the old policy's weights in the live parameters (and the compute copy), if kept."""
        old = self.old_policy
        return _swapped(old, self.params, self._sync_compute) if old is not None else contextlib.nullcontext()

    def _update_old_policy(self) -> None:
        """After a rollout's steps: old <- decay * old + (1 - decay) * trained, as DiffusionNFT after an epoch."""
        old = self.old_policy
        if old is None:
            return
        args = self.args
        old.update(self.params, old_policy_decay(self.optimizer_step, init=args.ema_decay_init, ramp=args.ema_decay_ramp,
                                                 maximum=args.ema_decay_max, flat_steps=args.ema_decay_flat_steps))

    # -- weights out --------------------------------------------------------------------------

    def synced_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """What a weight update reads: the compute copy's trained tensors (LoRA: the adapters)."""
        lora_only = self.lora is not None
        if self.old_policy is None:
            return synced_tensors(self.fmodel.transformers, self.components, lora_only=lora_only)
        # --ema-rollout-policy ema: the old policy's values, copied while it is swapped in (the live
        # tensors get the trained weights back when the swap ends, before a caller reads them)
        with self._rollout_policy_weights():
            return [(c, n, t.detach().clone()) for c, n, t in
                    synced_tensors(self.fmodel.transformers, self.components, lora_only=lora_only)]

    def weight_updates(self) -> list[WeightUpdate]:
        """The trained components as the engines hold them: from the compute copy when there is one
        (the compute dtype is the rollout dtype), so engines receive weights in --rollout-dtype.
        fsdp: gathered one parameter at a time and cast to the compute dtype; every rank must call it."""
        lora_only = self.lora is not None
        with resident(self.offload, optimizer=False, synced_only=True):
            if not self.sharded:
                with self._rollout_policy_weights():  # --ema-rollout-policy ema: the engines sample the old policy
                    return collect_weight_updates(self.fmodel.transformers, self.components, lora_only=lora_only)
            return collect_weight_updates(self.model.transformers, self.components, lora_only,
                                          to_host=lambda t: fsdp.full_tensor(t).to("cpu", copy=True),
                                          wire=self.wire_rule())

    def weight_digests(self) -> dict[str, str]:
        """Each transformer tensor's dtype and checksum as the train forward computes with it (the
        compute copy; fsdp: the master gathered, in the dtype the rule gathers it in; a collective)."""
        from miles.models.precision import weight_digests

        with resident(self.offload, optimizer=False):
            if not self.sharded:
                return weight_digests(self.fmodel.transformers)
            rule = self.wire_rule()
            return weight_digests(self.model.transformers,
                                  lambda c, n, t: fsdp.full_tensor(t.detach()).to(rule(c, n, t.dtype)))

    def wire_rule(self):
        """What each synced tensor travels in: the dtype the engine holds it in (miles.models.precision)."""
        return wire_rule(self.model.transformers, torch_dtype(self.args.compute_dtype))

    def trained_state(self) -> dict[str, torch.Tensor]:
        """Every trained tensor by `<component>.<param name>`, whole CPU copies (tests compare runs with
        it; fsdp: gathered, so every rank must call it)."""
        with resident(self.offload, optimizer=False):
            return {n: fsdp.full_tensor(p.detach()).cpu().clone() for n, p in self.params.items()}

    # -- checkpoints --------------------------------------------------------------------------

    def begin_save(self, staging: str) -> None:
        """Copy the checkpoint's state to the host and start writing it in the background
        (miles.backends.checkpoint_writer); `save_done`/`finish_save` tell when it is written."""
        staging = Path(staging)
        self.finish_save()  # one write at a time (the driver waits already; a direct caller may not)
        torch.save(ckpt.rng_state(), staging / f"rng_rank{self.rank}.pt")
        with resident(self.offload, optimizer=True):
            begin = checkpoint_writer.begin_sharded if self.sharded else checkpoint_writer.begin_whole
            self.pending_save = begin(self, staging)

    def save_done(self) -> bool:
        """Whether this rank's background write has ended (its error, if any, comes from finish_save)."""
        return getattr(self, "pending_save", None) is None or self.pending_save.done()

    def finish_save(self) -> None:
        """Wait for this rank's background write; raises what the writer raised."""
        pending, self.pending_save = getattr(self, "pending_save", None), None
        if pending is not None:
            pending.wait()

    def save(self, staging: str) -> None:
        """A save that returns once this rank's files are written."""
        self.begin_save(staging)
        self.finish_save()

    @torch.no_grad()
    def load(self, path: str) -> None:
        path = Path(path)
        with resident(self.offload, optimizer=True):
            if self.sharded:
                self.optimizer_step = fsdp.load_sharded(path, self.model, self.components, self.params,
                                                        self.optimizer, self.ema)
            else:
                self._load_whole(path)
        rng_file = path / f"rng_rank{self.rank}.pt"
        ckpt.set_rng_state(torch.load(rng_file if rng_file.exists() else path / "rng_rank0.pt", weights_only=False))

    def _load_whole(self, path: Path) -> None:
        fsdp.check_backend(path, "dp")
        for component in self.components:
            stored = ckpt.load_tensors(path / f"model_{component}.safetensors")
            for name, tensor in stored.items():
                self.params[f"{component}.{name}"].copy_(tensor)
            for prefix, kept in (("ema", self.ema), ("old_policy", self.old_policy)):
                if kept is not None and (path / f"{prefix}_{component}.safetensors").exists():
                    shadow = ckpt.load_tensors(path / f"{prefix}_{component}.safetensors")
                    kept.load_state_dict({**kept.shadow, **{f"{component}.{n}": t for n, t in shadow.items()}})
        self._sync_compute()
        state = torch.load(path / "optimizer.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_step = state["optimizer_step"]


def enable_gradient_checkpointing(module: torch.nn.Module, family: str, component: str) -> None:
    """--gradient-checkpointing through the diffusers API, or an error naming the family."""
    if not getattr(module, "_supports_gradient_checkpointing", False) or not hasattr(
            module, "enable_gradient_checkpointing"):
        raise ValueError(f"--gradient-checkpointing: the {family} family's {component} "
                         f"({type(module).__name__}) does not support gradient checkpointing; drop the flag")
    module.enable_gradient_checkpointing()
    if not getattr(module, "is_gradient_checkpointing", True):
        raise ValueError(f"--gradient-checkpointing: enabling it on the {family} family's {component} "
                         f"({type(module).__name__}) had no effect; drop the flag")


@contextlib.contextmanager
def _swapped(ema: EMA, params: dict[str, torch.nn.Parameter], sync_compute):
    """The EMA's weights in `params` and (through `sync_compute`) the compute copy, restored after."""
    try:
        with ema.swapped_in(params):
            sync_compute()
            yield
    finally:
        sync_compute()

