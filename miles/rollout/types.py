"""What crosses the process boundary between rollout engines and the trainer.

Plain dataclasses of tensors, lists and dicts, so they pickle through Ray unchanged. Tensors are
always on the CPU when they leave an engine. In a training run an engine keeps what it made in
Ray's object store and answers each request with a `StoredSample` (where the parts lie): the
reward workers and the train ranks fetch them from there, the driver never holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from miles.models.conditioning import Conditioning  # noqa: F401  (a trajectory carries one; it lives with the models)


@dataclass
class SamplingParams:
    """How an engine samples; fixed per engine, built from the flags by `from_args`."""

    num_steps: int = 10
    height: int = 64
    width: int = 64
    num_frames: int = 1
    guidance_scale: float = 4.0
    guidance_scale_2: float | None = None  # Wan2.2's low-noise expert
    noise_level: float = 0.7
    sde_type: str | None = None  # None = the family's default
    shift: float | None = None  # None = the checkpoint's scheduler config
    max_sequence_length: int | None = None  # prompt tokens; None = the family pipeline's default
    negative_prompt: str = ""
    microgroup_size: int | None = None  # samples evaluated together; None = all of a group
    eval_num_steps: int | None = None  # denoising steps of an eval sample; None = num_steps

    def for_eval(self) -> "SamplingParams":
        """These params as an eval sample uses them (--diffusion-eval-num-steps)."""
        return replace(self, num_steps=self.eval_num_steps or self.num_steps)

    @classmethod
    def from_args(cls, args) -> "SamplingParams":
        return cls(
            num_steps=args.diffusion_num_steps,
            height=args.diffusion_height,
            width=args.diffusion_width,
            num_frames=args.diffusion_output_num_frames,
            guidance_scale=args.diffusion_guidance_scale,
            guidance_scale_2=args.diffusion_guidance_scale_2,
            noise_level=args.diffusion_noise_level,
            sde_type=args.diffusion_sde_type,
            shift=args.diffusion_shift,
            max_sequence_length=getattr(args, "diffusion_max_sequence_length", None),
            negative_prompt=args.negative_prompt,
            microgroup_size=args.rollout_microgroup_size,
            eval_num_steps=getattr(args, "diffusion_eval_num_steps", None),
        )


@dataclass
class SampleRequest:
    prompt: str
    group_index: int  # which prompt of the rollout batch
    sample_index: int  # which of that prompt's n samples
    seed: int  # all noise of this sample comes from a generator seeded with it
    metadata: dict[str, Any] = field(default_factory=dict)
    # what the engine keeps of it in a training run (miles.rollout.engine_store): the steps whose
    # model outputs the parity probe compares, how many frames its reward reads as uint8 (0: every
    # frame as decoded), and whether the driver wants a thumbnail of it for the progress picture
    output_steps: tuple[int, ...] = ()
    reward_frames: int = 0
    thumbnail: bool = False


@dataclass
class Trajectory:
    """One sample's denoising path. N = number of steps.

    Step k goes from latent(k) at sigmas[k] to latent(k + 1) at sigmas[k + 1] using expert
    `experts[k]` with guidance `guidance_scales[k]`; `log_probs[k]` is that step's log-density
    (0 for steps outside `trained_steps`, which run as ODE).

    The sampler records the whole path (`latents` [N + 1, ...], every step's model output in debug
    mode, the decoded sample). What a train rank receives is `for_training`: the latents of the
    trained steps and the final one, in the dtype they were computed in, the model outputs of the
    steps the parity probe compares, no pixels; `latent_steps` / `output_steps` then say which step
    each row is. Its conditioning travels once per prompt group (miles.rollout.engine_store).
    """

    prompt: str
    group_index: int
    sample_index: int
    seed: int
    latents: torch.Tensor  # [N + 1, *latent_shape] (or the rows of `latent_steps`), fp32
    sigmas: torch.Tensor  # [N + 1], fp32, from 1.0 down to 0.0
    log_probs: torch.Tensor  # [N], fp32
    trained_steps: list[int]
    cond: Conditioning | None  # batch of one, both prompt and negative prompt
    experts: list[str]  # [N] transformer component per step
    guidance_scales: list[float]  # [N]
    sde_type: str
    noise_level: float
    image: torch.Tensor | None  # [3, H, W] or [F, 3, H, W], float in [0, 1]; None once trimmed
    model_outputs: torch.Tensor | None = None  # [N, *latent_shape] guided velocity, debug mode only
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    latent_steps: list[int] | None = None  # the step of each row of `latents`; None: every step
    output_steps: list[int] | None = None  # the step of each row of `model_outputs`; None: every step

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[0]

    def latent(self, step: int) -> torch.Tensor:
        """The latent before step `step` (-1: the final one)."""
        step = step % (self.num_steps + 1)
        if self.latent_steps is None:
            return self.latents[step]
        if step not in self.latent_steps:
            raise KeyError(f"sample {self.group_index}/{self.sample_index}: the latent of step {step} was not kept "
                           f"(kept: {self.latent_steps})")
        return self.latents[self.latent_steps.index(step)]

    def model_output(self, step: int) -> torch.Tensor | None:
        """The engine's model output at `step`, or None where none was kept."""
        if self.model_outputs is None:
            return None
        if self.output_steps is None:
            return self.model_outputs[step]
        return self.model_outputs[self.output_steps.index(step)] if step in self.output_steps else None

    def for_training(self, output_steps: tuple[int, ...] | list[int] = ()) -> "Trajectory":
        """What a train rank reads of it: the trained steps' latents (each step's start and end) and
        the final latent (DiffusionNFT's x0), the model outputs of `output_steps`, no conditioning
        (it travels once per prompt group) and no pixels (the reward workers had them). Copies, so a
        pickled row does not carry the whole path."""
        kept = sorted({k for s in self.trained_steps for k in (s, s + 1)} | {self.num_steps})
        outputs = sorted(set(output_steps))
        if outputs and self.model_outputs is None:
            raise ValueError(f"model outputs of steps {outputs} were asked for, but the sample recorded none "
                             f"(sampled without debug mode)")
        return replace(
            self, latents=torch.stack([self.latent(k) for k in kept]), latent_steps=kept, cond=None, image=None,
            model_outputs=torch.stack([self.model_output(k) for k in outputs]) if outputs else None,
            output_steps=outputs if outputs else None)


@dataclass
class StoredSample:
    """An engine's answer for one sample of a training run or an eval: where its parts lie in Ray's
    object store (references, a few dozen bytes each), and the little the driver reads itself."""

    group_index: int
    sample_index: int
    reward_input: Any  # ObjectRef of the RewardSample its reward workers score (uint8 frames where they read 8 bits)
    num_steps: int  # denoising steps it ran
    trajectory: Any = None  # ObjectRef of `Trajectory.for_training`; None in an eval (nobody trains on it)
    cond: Any = None  # ObjectRef of its prompt group's Conditioning (batch of one), shared by the group
    thumbnail: Any = None  # uint8 numpy [3, h, w], h and w at most THUMBNAIL_SIDE, when the request asked
