"""One train step of a rank on a rollout batch: the forwards on the stored steps, the policy or
DiffusionNFT loss, the KL reference, the all-reduce and the optimizer step. `RolloutTrainStep` is
a mixin of `miles.backends.actor.TrainRank`, which holds the state it runs on (models, params,
optimizer, collectives; set up in `TrainRank.setup`), so every method keeps its name on the rank."""

from __future__ import annotations

import resource
import time
import zlib
from dataclasses import dataclass

import torch

from miles.backends import fsdp
from miles.backends.loss import NFTInputs, PolicyLossInputs, nft_loss, policy_loss, trained_pairs_mask
from miles.backends.lora import adapters_disabled
from miles.backends.old_log_probs import old_log_probs, recompute_old_log_probs
from miles.backends.optimizer import clip_gradients, decay_steps, learning_rate, set_learning_rate
from miles.backends.train_offload import resident
from miles.backends.sft import SFTBatch
from miles.backends.types import RolloutBatch, TrainResult
from miles.rollout.sde import largest_sigma_below_one, sde_step_on_host
from miles.rollout.types import Conditioning
from miles.flags.batching import Pair, expand_pairs, rank_schedule, shard_pairs
from miles.backends.parity_probe import _ParityProbe, probe_limit, probed_extra_micro_batches


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


class RolloutTrainStep:
    """`TrainRank.train` and the steps under it (see the module's docstring)."""

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
