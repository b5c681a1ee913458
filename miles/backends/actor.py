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
import resource
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from miles.backends import checkpoint as ckpt
from miles.backends import checkpoint_writer
from miles.backends.collectives import Collectives, host_store
from miles.backends import fsdp
from miles.backends.ema import EMA, old_policy_decay
from miles.backends.loss import (
    NFTInputs,
    PolicyLossInputs,
    load_custom_loss,
    nft_loss,
    policy_loss,
    trained_pairs_mask,
)
from miles.backends.lora import LoraSpec, adapters_disabled, attach_lora, lora_spec_from_args
from miles.backends.old_log_probs import old_log_probs, recompute_old_log_probs
from miles.backends.optimizer import build_optimizer, clip_gradients, decay_steps, learning_rate, set_learning_rate
from miles.backends.train_offload import TrainOffload, resident
from miles.backends.sft import SFTBatch, SFTRankStep
from miles.backends.types import RolloutBatch, TrainResult
from miles.backends.weight_sync import WeightUpdate, collect_weight_updates, sync_components, synced_tensors, wire_rule
from miles.records import phases
from miles.rollout.sampler import expert_phases
from miles.rollout.sde import largest_sigma_below_one, sde_step_on_host
from miles.rollout.types import Conditioning, SamplingParams
from miles.flags.batch_rules import ConfigError, high_noise_step_count
from miles.flags.batching import Pair, expand_pairs, rank_schedule, shard_pairs

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def torch_dtype(name: str | None) -> torch.dtype:
    return getattr(torch, name or "float32")


class TrainRank:
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

    # -- one rollout --------------------------------------------------------------------------

    def train(self, batch: RolloutBatch | SFTBatch) -> TrainResult:
        with resident(self.offload, optimizer=True):
            if isinstance(batch, SFTBatch):  # sft_loss: dataset items, not rollouts (miles.backends.sft)
                return self.sft.train(batch)
            return self._train_rollout(batch)

    def _train_rollout(self, batch: RolloutBatch) -> TrainResult:
        args = self.args
        start = time.perf_counter()
        schedule = rank_schedule(self.plan, batch.trained_steps, self.rank)
        if self.sharded:
            fsdp.check_same_expert_sequence([self._pair_tensors(batch, mb)[1] for w in schedule for mb in w],
                                            self.world_size)
        shard = shard_pairs(expand_pairs(self.plan.samples_per_rollout, batch.trained_steps),
                            self.plan.dp_size, self.rank, self.plan.dp_split_mode)
        limit = probe_limit(args)
        probe = _ParityProbe(limit) if args.diffusion_debug_mode else None
        nft = args.loss_type == "nft"
        with self._rollout_policy_weights():  # the weights the engines sampled this rollout with
            if probe is not None:
                # pairs after the first optimizer step would see new weights: check them now (nft: all
                # of them, its training forwards run on renoised samples)
                for micro in probed_extra_micro_batches(schedule, limit, first_window_free=not nft):
                    with torch.no_grad():
                        self._forward(batch, micro, probe)
            v_old = self._old_velocities(batch, schedule) if nft else None
            self._recomputed = (recompute_old_log_probs(self, batch, schedule)
                                if getattr(args, "diffusion_recompute_old_log_prob", False) else None)

        totals: dict[str, float] = {}
        for window_index, window in enumerate(schedule):
            window_weight = sum(self._loss_weight(batch, mb) for mb in window)
            for micro in window:
                loss, metrics = self._micro_batch_loss(batch, micro, None if nft or window_index else probe, v_old)
                # each micro-batch's mean weighted by its share of the window's loss-carrying pairs
                share = self._loss_weight(batch, micro) / window_weight if window_weight else 0.0
                (loss * share).backward()
                for key, value in {"loss": loss.detach(), **metrics}.items():
                    totals[key] = totals.get(key, 0.0) + torch.as_tensor(value, dtype=torch.float64) * share / len(schedule)
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + self._optimizer_step().double() / len(schedule)
        self._update_old_policy()
        elapsed = time.perf_counter() - start  # the step's one read of the device: its metrics, here
        metrics = self._reduce({f"train/{k}": float(v) for k, v in totals.items()}, probe)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["perf/train_time"] = elapsed
        metrics["perf/train_pairs_per_sec"] = len(shard) * self.world_size / elapsed
        metrics["perf/peak_memory_bytes"] = self._peak_memory()
        return TrainResult(self.rank, metrics, shard)

    def _pair_tensors(self, batch: RolloutBatch, pairs: list[Pair]):
        trajs = [batch.trajectories[p.sample] for p in pairs]
        experts = {t.experts[p.step] for t, p in zip(trajs, pairs)}
        guidance = {t.guidance_scales[p.step] for t, p in zip(trajs, pairs)}
        if len(experts) > 1 or len(guidance) > 1:
            raise ValueError(f"micro-batch {pairs} mixes experts {experts} or guidance scales {guidance}")
        return trajs, experts.pop(), guidance.pop()

    def _forward(self, batch: RolloutBatch, pairs: list[Pair], probe: "_ParityProbe | None",
                 before_forward=None, train: bool = False):
        """The model output and SDE step of stored pairs under the current weights.

        `pairs` is one rollout tile (the batch plan refuses any other layout): an engine microgroup's
        samples at one step, in its order, so `velocity` runs the engine's very batch (the
        unconditional half detached in the same call when training) and gives the engine's bits.

        `before_forward(ctx)` runs before the graph is built (the EMA reference swaps weights in place,
        which must not happen to tensors a pending backward has saved).
        """
        trajs, expert, guidance = self._pair_tensors(batch, pairs)
        gather = lambda fn: torch.stack([fn(t, p) for t, p in zip(trajs, pairs)]).to(self.device)  # noqa: E731
        x = gather(lambda t, p: t.latent(p.step))
        x_next = gather(lambda t, p: t.latent(p.step + 1))
        sigma = gather(lambda t, p: t.sigmas[p.step])
        sigma_next = gather(lambda t, p: t.sigmas[p.step + 1])
        old_log_prob = gather(lambda t, p: t.log_probs[p.step])
        cond = Conditioning.cat([t.cond for t in trajs])
        ctx = _StepContext(x, x_next, sigma, sigma_next, cond, guidance, expert, trajs[0].noise_level,
                           trajs[0].sde_type, largest_sigma_below_one(trajs[0].sigmas.tolist()))
        if before_forward is not None:
            before_forward(ctx)
        velocity = self._train_velocity if train else self.fmodel.velocity
        step = self._step(ctx, velocity(x, sigma, cond, guidance, expert))
        if probe is not None and probe.wants():
            stored = [t.model_output(p.step) for t, p in zip(trajs, pairs)]
            if any(s is None for s in stored):  # the driver asks the engines for what the probe compares
                raise ValueError(f"the parity probe compares micro-batch {pairs}, but the engine kept no model "
                                 f"output for it (miles.backends.rollout_shard.probed_outputs)")
            probe.add(step.v.detach().cpu(), torch.stack(stored), step.log_prob.detach().cpu(), old_log_prob.cpu())
        return step, old_log_prob, ctx

    @staticmethod
    def _step(ctx: "_StepContext", v: torch.Tensor):
        # on the host, as the engine stepped (sde_step_on_host says why)
        step = sde_step_on_host(ctx.x, v, ctx.sigma, ctx.sigma_next, ctx.noise_level, ctx.sde_type,
                                x_next=ctx.x_next, sigma_max=ctx.sigma_max)
        step.v = v
        return step

    def _loss_weight(self, batch: RolloutBatch, pairs: list[Pair]) -> int:
        """Pairs of a micro-batch that the loss averages over (policy_loss drops zero advantages)."""
        if self.args.loss_type != "policy_loss":
            return len(pairs)
        return int(self._kept(batch, pairs).sum())

    def _kept(self, batch: RolloutBatch, pairs: list[Pair]) -> torch.Tensor:
        advantages = torch.tensor([batch.advantages[p.sample] for p in pairs])
        # a custom loss sees every pair (and `inputs.keep`), and averages as it chooses
        keep_all = self.args.keep_zero_advantage_samples or self.custom_loss is not None
        return trained_pairs_mask(advantages, keep_all)

    def _train_velocity(self, x, sigma, cond, guidance, expert) -> torch.Tensor:
        """The velocity that carries gradient (the unconditional CFG branch detached unless asked)."""
        return self.fmodel.velocity(x, sigma, cond, guidance, expert, detach_uncond=not self.args.train_uncond_branch)

    def _micro_batch_loss(self, batch, pairs, probe, v_old):
        args = self.args
        advantages = torch.tensor([batch.advantages[p.sample] for p in pairs])
        if args.loss_type == "nft":
            return self._nft_loss(batch, pairs, advantages, v_old)
        reference = {}
        before = (lambda ctx: reference.update(mean=self._reference_mean(ctx))) if args.diffusion_kl_beta > 0 else None
        step, old_log_prob, ctx = self._forward(batch, pairs, probe, before, train=True)
        ref_mean = reference.get("mean")
        old_log_prob = old_log_probs(getattr(self, "_recomputed", None), pairs, old_log_prob)
        inputs = PolicyLossInputs(step.log_prob, old_log_prob, advantages.to(self.device), step.mean, step.std, ref_mean,
                                  std_dev_t=step.std_dev_t, keep=self._kept(batch, pairs).to(self.device))
        if self.custom_loss is not None:
            return self.custom_loss(args, inputs)
        return policy_loss(inputs, clip_range=args.diffusion_clip_range, kl_beta=args.diffusion_kl_beta)

    def _nft_loss(self, batch, pairs, advantages, v_old):
        args = self.args
        x_t, x0, sigma, cond, guidance, expert = self._renoised(batch, pairs)
        # the reference forward first: the EMA reference swaps weights in place, which must not touch
        # tensors the training forward's graph has saved
        v_ref = self._reference_velocity(x_t, sigma, cond, guidance, expert) if args.diffusion_kl_beta > 0 else None
        v_new = self._train_velocity(x_t, sigma, cond, guidance, expert)
        inputs = NFTInputs(v_new, torch.stack([v_old[p] for p in pairs]), x_t, x0, sigma, advantages.to(self.device),
                           v_ref)
        return nft_loss(inputs, beta=args.nft_beta, adv_clip_max=args.diffusion_adv_clip_max,
                        adaptive_weight=args.diffusion_nft_adaptive_weight, kl_beta=args.diffusion_kl_beta)

    @torch.no_grad()
    def _reference_mean(self, ctx: "_StepContext") -> torch.Tensor:
        return self._step(ctx, self._reference_velocity(ctx.x, ctx.sigma, ctx.cond, ctx.guidance, ctx.expert)).mean

    @torch.no_grad()
    def _reference_velocity(self, x, sigma, cond, guidance, expert) -> torch.Tensor:
        reference = self.args.diffusion_kl_reference
        if reference == "auto":
            reference = "lora_base" if self.lora is not None else "ema"
        if reference == "lora_base":
            if self.lora is None:
                raise ValueError("--diffusion-kl-reference lora_base needs --use-lora")
            with adapters_disabled([self.fmodel.transformers[c] for c in self.components]):
                return self.fmodel.velocity(x, sigma, cond, guidance, expert)
        if self.ema is None:
            raise ValueError("a KL against the EMA needs --use-ema")
        with self.ema.swapped_in(self.params):
            self._sync_compute()
            v_ref = self.fmodel.velocity(x, sigma, cond, guidance, expert)
        self._sync_compute()
        return v_ref

    def _renoised(self, batch: RolloutBatch, pairs: list[Pair]):
        """DiffusionNFT's forward-process sample x_t = (1 - s) x0 + s e at each pair's sigma.

        The noise is a function of (seed, rollout, pair) alone, so it is the same on any rank
        count and after a resume.
        """
        trajs, expert, guidance = self._pair_tensors(batch, pairs)
        x0 = torch.stack([t.latent(-1) for t in trajs]).to(self.device)
        noise = torch.stack([
            torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(
                zlib.crc32(f"{self.args.seed}:{batch.rollout_id}:{p.sample}:{p.step}".encode())))
            for p in pairs]).to(self.device)
        sigma = torch.stack([t.sigmas[p.step] for t, p in zip(trajs, pairs)]).to(self.device)
        s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - s) * x0 + s * noise
        return x_t, x0, sigma, Conditioning.cat([t.cond for t in trajs]), guidance, expert

    @torch.no_grad()
    def _old_velocities(self, batch: RolloutBatch, schedule: list[list[list[Pair]]]) -> dict[Pair, torch.Tensor]:
        """The sampling policy's velocities (called under `_rollout_policy_weights`), forwarded in the
        train micro-batches themselves: at equal weights they are then the training forward's bits."""
        out = {}
        for micro in (mb for window in schedule for mb in window):
            x_t, _, sigma, cond, guidance, expert = self._renoised(batch, micro)
            out.update(zip(micro, self.fmodel.velocity(x_t, sigma, cond, guidance, expert)))
        return out

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

    def _optimizer_step(self) -> torch.Tensor:
        params = list(self.params.values())
        if self.sharded:  # backward has reduce-scattered each micro-batch's gradients into the shards
            grad_norm = fsdp.clip_gradients(params, self.args.clip_grad)
        else:
            self._all_reduce_gradients(params)
            grad_norm = clip_gradients(params, self.args.clip_grad)
        if not self.args.debug_skip_optimizer_step:
            set_learning_rate(self.optimizer, self._lr())
            self.optimizer.step()
            self.optimizer_step += 1
            if self.ema is not None:
                self.ema.update(self.params)
        self.optimizer.zero_grad(set_to_none=True)
        self._sync_compute()
        return grad_norm

    def _all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        sources = list(self.fparams.values())  # where backward left the gradients
        # reduced and stepped in the param dtype. Memory: each gradient is cast straight into the flat
        # buffer (no list of cast copies) and, on a compute copy, freed as soon as it is packed
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for s, p in zip(sources, params):
            n = p.numel()
            if s.grad is None:
                flat[offset:offset + n].zero_()
            else:
                flat[offset:offset + n].copy_(s.grad.reshape(-1))
                if self.fparams is not self.params:
                    s.grad = None
            offset += n
        if self.world_size > 1:
            self.comm.all_reduce(flat)
            flat /= self.world_size
        offset = 0
        for p in params:  # views of the one reduced buffer: no second copy of the gradients
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def _lr(self) -> float:
        args = self.args
        if getattr(self, "_decay_steps", None) is None:  # --num-epoch: counted from the prompt data once
            self._decay_steps = decay_steps(args, self.plan.num_steps_per_rollout)
        total = self._decay_steps
        return learning_rate(self.optimizer_step, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_steps,
                             total_steps=total, decay_style=args.lr_decay_style)

    def _reduce(self, metrics: dict[str, float], probe: "_ParityProbe | None") -> dict[str, float]:
        if probe is not None and probe.count:
            metrics["train/model_output_mean_abs_diff"] = probe.abs_sum / probe.count
            metrics["train/model_output_max_abs_diff"] = probe.abs_max
            metrics["train/log_prob_abs_diff"] = probe.log_prob_max
        if self.world_size == 1:
            return metrics
        keys = sorted(metrics)
        maxed = [k for k in keys if k.endswith("max_abs_diff") or k == "train/log_prob_abs_diff"]
        summed = [k for k in keys if k not in maxed]
        sums = self.comm.all_reduce(self.comm.metric_tensor([metrics[k] for k in summed]))
        out = {k: float(v) / self.world_size for k, v in zip(summed, sums)}
        if probe is not None:  # the mean diff is a mean over every rank's elements
            counts = self.comm.all_reduce(self.comm.metric_tensor([probe.abs_sum, float(probe.count)]))
            out["train/model_output_mean_abs_diff"] = float(counts[0] / counts[1]) if counts[1] else 0.0
        if maxed:
            maxes = self.comm.all_reduce(self.comm.metric_tensor([metrics[k] for k in maxed]), op="max")
            out.update({k: float(v) for k, v in zip(maxed, maxes)})
        return out

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

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


@dataclass
class _StepContext:
    """A micro-batch's stored step, on the train device, ready to re-run under any weights."""

    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    cond: Conditioning
    guidance: float
    expert: str
    noise_level: float
    sde_type: str
    sigma_max: float


@contextlib.contextmanager
def _swapped(ema: EMA, params: dict[str, torch.nn.Parameter], sync_compute):
    """The EMA's weights in `params` and (through `sync_compute`) the compute copy, restored after."""
    try:
        with ema.swapped_in(params):
            sync_compute()
            yield
    finally:
        sync_compute()


def probe_limit(args) -> int:
    """Micro-batches of a rollout the parity probe checks (0: every one). Unset, the CPU tier
    checks every one and a GPU run one (benchmarks/bench_parity_probe.py: its cost)."""
    limit = getattr(args, "diffusion_debug_probe_micro_batches", None)
    if limit is None:
        return 0 if getattr(args, "device", "cpu") == "cpu" else 1
    return limit


def probed_extra_micro_batches(schedule: list[list[list[Pair]]], limit: int,
                               first_window_free: bool = True) -> list[list[Pair]]:
    """The micro-batches the parity probe re-runs as extra no-grad forwards on the rollout's
    weights. `limit` (--diffusion-debug-probe-micro-batches) is how many micro-batches of a rollout
    the probe checks, 0 every one. With `first_window_free` the first optimizer step's micro-batches
    are checked by their own training forward (they run anyway), so only later ones are re-run, for
    what that step lacks; NFT trains on renoised samples, so every checked micro-batch is re-run.
    The same positions on every rank, so sharded ranks all-gather alike."""
    free = len(schedule[0]) if first_window_free else 0
    extra = [mb for window in schedule[1 if first_window_free else 0:] for mb in window]
    return extra[:max(0, limit - free)] if limit else extra


def probed_micro_batches(schedule: list[list[list[Pair]]], limit: int, nft: bool) -> list[list[Pair]]:
    """Every micro-batch `_train_rollout` hands the probe, in its order: the extra forwards first,
    then (policy loss) the first optimizer step's training forwards while the probe wants more."""
    extra = probed_extra_micro_batches(schedule, limit, first_window_free=not nft)
    if nft:
        return extra
    first = schedule[0] if schedule else []
    return extra + (first[:max(0, limit - len(extra))] if limit else first)


class _ParityProbe:
    """Train-side model outputs against the engine's, on the weights that made the rollout."""

    def __init__(self, limit: int = 0):
        self.abs_sum, self.abs_max, self.count, self.log_prob_max = 0.0, 0.0, 0, 0.0
        self.limit, self.micro_batches = limit, 0  # limit 0: every micro-batch

    def wants(self) -> bool:
        return not self.limit or self.micro_batches < self.limit

    def add(self, v: torch.Tensor, stored: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> None:
        diff = (v.float() - stored.float()).abs()
        self.abs_sum += float(diff.sum(dtype=torch.float64))
        self.abs_max = max(self.abs_max, float(diff.max()))
        self.count += diff.numel()
        self.log_prob_max = max(self.log_prob_max, float((log_prob - old_log_prob).abs().max()))
        self.micro_batches += 1

