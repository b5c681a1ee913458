"""Supervised finetuning (`--loss-type sft_loss`, `--train-only`): flow matching on a fixed dataset.

Driver side, `SFTSource` stands where the rollout manager stands in the loop: per rollout id it
draws the next `rollout_batch_size` items of the dataset (its position is checkpointed) and the
trained timesteps of the step strategy (seeded by `--rollout-seed` and the rollout id). Nothing
is sampled and nothing is scored; there are no engines to update.

Rank side, `SFTRankStep` trains the pairs (sample, step) that the batch plan deals the rank,
walked exactly as for RL (`miles.flags.batching.rank_schedule`): for each pair
    x0 = encode_images(media),  s = sigmas[step],  e ~ N(0, I) (seeded by seed, rollout, pair)
    x_t = (1 - s) x0 + s e,  target = e - x0,  loss = |v(x_t, s, prompt) - target|^2
with the prompt encoded by the checkpoint's own text encoder and no guidance. The velocity picks
the transformer per sample from its sigma (`DiffusionModel.expert_for`: Wan2.2's high-noise
`transformer` or low-noise `transformer_2`), so a pair's gradient lands only on the expert that
owns its timestep; frozen parts (VAE, text encoder, untrained experts) get none.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch

from miles.backends.loss import sft_loss
from miles.backends.sft_data import SFTDataError, SFTDataset, SFTItem, load_pixels
from miles.backends.types import TrainResult
from miles.rollout.step_strategy import trained_steps_for_rollout
from miles.rollout.types import Conditioning
from miles.flags.batching import Pair, expand_pairs, rank_schedule, shard_pairs

# frozen encoders: a sample's latents and a prompt's conditioning never change, so ranks keep them
CACHE_LIMIT = 4096


@dataclass
class SFTBatch:
    """One rollout id of SFT: sample s is item s // n_samples_per_prompt (its own noise per pair)."""

    rollout_id: int
    items: list[SFTItem]
    n_samples_per_prompt: int
    trained_steps: list[int]

    def item(self, sample: int) -> SFTItem:
        return self.items[sample // self.n_samples_per_prompt]


class SFTSource:
    """The driver's side of an SFT run, with the rollout manager's interface."""

    def __init__(self, args):
        self.args = args
        self.dataset = SFTDataset.from_args(args)
        self.last_images: list[torch.Tensor] = []  # nothing is generated
        frames = args.diffusion_output_num_frames
        wanted = (args.diffusion_height, args.diffusion_width)
        for item in self.dataset.items:
            if (item.height, item.width) != wanted or (frames > 1 and item.frames != frames):
                raise SFTDataError(
                    f"{self.dataset.source}: item {item.index} is {item.height}x{item.width}x{item.frames}, but the run "
                    f"trains {wanted[0]}x{wanted[1]}x{frames} (--diffusion-height/-width/-output-num-frames)")

    def generate(self, rollout_id: int) -> tuple[SFTBatch, dict[str, float]]:
        start = time.perf_counter()
        items = self.dataset.next_batch(self.args.rollout_batch_size)
        batch = SFTBatch(rollout_id, items, self.args.n_samples_per_prompt, trained_steps_for_rollout(self.args, rollout_id))
        return batch, {"rollout/trained_steps": len(batch.trained_steps), "rollout/epoch": self.dataset.epoch,
                       "perf/data_time": time.perf_counter() - start}

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return {}  # eval samples images, which needs engines; SFT runs none

    def apply_lora(self, spec, components) -> None:
        pass  # no engines to mirror the adapters

    def state_dict(self) -> dict:
        return {"sft_dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state["sft_dataset"])

    def shutdown(self) -> None:
        pass


def pair_noise(seed: int, rollout_id: int, pair: Pair, shape) -> torch.Tensor:
    """A pair's noise: a function of (seed, rollout, pair) alone, so any rank count and a resume agree."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"sft:{seed}:{rollout_id}:{pair.sample}:{pair.step}".encode()))
    return torch.randn(tuple(shape), generator=generator)


class SFTRankStep:
    """One train rank's SFT work for a rollout id; `rank` is the `TrainRank` it runs in."""

    def __init__(self, rank):
        self.rank = rank
        self.latents: dict[str, torch.Tensor] = {}  # media path -> x0 (CPU)
        self.conds: dict[str, Conditioning] = {}  # prompt -> conditioning of batch 1 (CPU)

    def _x0(self, item: SFTItem) -> torch.Tensor:
        if item.media not in self.latents:
            model = self.rank.fmodel
            x0 = model.encode_images(load_pixels(item, model.spec.is_video)[None])[0].cpu()
            if len(self.latents) >= CACHE_LIMIT:
                return x0
            self.latents[item.media] = x0
        return self.latents[item.media]

    def _cond(self, prompt: str) -> Conditioning:
        if prompt not in self.conds:
            cond = self.rank.fmodel.encode_prompts([prompt], negative_prompt=None).to("cpu")
            if len(self.conds) >= CACHE_LIMIT:
                return cond
            self.conds[prompt] = cond
        return self.conds[prompt]

    def micro_batch_loss(self, batch: SFTBatch, pairs: list[Pair], sigmas: list[float]) -> torch.Tensor:
        model, device = self.rank.fmodel, self.rank.device
        x0 = torch.stack([self._x0(batch.item(p.sample)) for p in pairs]).to(device)
        noise = torch.stack([pair_noise(self.rank.args.seed, batch.rollout_id, p, x0.shape[1:]) for p in pairs]).to(device)
        sigma = torch.tensor([sigmas[p.step] for p in pairs], dtype=torch.float32)
        s = sigma.to(device).reshape(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - s) * x0 + s * noise
        cond = Conditioning.cat([self._cond(batch.item(p.sample).prompt) for p in pairs])
        v = model.velocity(x_t, sigma, cond, guidance_scale=1.0, expert=None)  # the expert owning each sigma
        return sft_loss(v, x0, noise)[0]

    def train(self, batch: SFTBatch) -> TrainResult:
        rank = self.rank
        args, plan = rank.args, rank.plan
        start = time.perf_counter()
        schedule = rank_schedule(plan, batch.trained_steps, rank.rank)
        shard = shard_pairs(expand_pairs(plan.samples_per_rollout, batch.trained_steps), plan.dp_size, rank.rank,
                            plan.dp_split_mode)
        sigmas = rank.model.sigmas(args.diffusion_num_steps, args.diffusion_shift, args.diffusion_height,
                                   args.diffusion_width, args.diffusion_output_num_frames)
        loss_total = grad_norm_total = 0.0
        for window in schedule:
            window_pairs = sum(len(mb) for mb in window)
            for micro in window:
                loss = self.micro_batch_loss(batch, micro, sigmas)
                share = len(micro) / window_pairs
                if loss.requires_grad:  # a pair of an expert that is not trained has nothing to update
                    (loss * share).backward()
                loss_total += loss.detach().double() * share / len(schedule)
            grad_norm_total += rank._optimizer_step().double() / len(schedule)
        elapsed = time.perf_counter() - start  # the one read of the device below ends the step
        metrics = rank._reduce({"train/loss": float(loss_total), "train/grad_norm": float(grad_norm_total)}, None)
        metrics["train/lr"] = rank.optimizer.param_groups[0]["lr"]
        metrics["perf/train_time"] = elapsed
        metrics["perf/train_pairs_per_sec"] = len(shard) * rank.world_size / elapsed
        metrics["perf/peak_memory_bytes"] = rank._peak_memory()
        return TrainResult(rank.rank, metrics, shard)
