"""What crosses the process boundary between rollout engines and the trainer.

Plain dataclasses of tensors, lists and dicts, so they pickle through Ray unchanged. Tensors are
always on the CPU when they leave an engine.
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


@dataclass
class Trajectory:
    """One sample's denoising path. N = number of steps.

    Step k goes from latents[k] at sigmas[k] to latents[k + 1] at sigmas[k + 1] using expert
    `experts[k]` with guidance `guidance_scales[k]`; `log_probs[k]` is that step's log-density
    (0 for steps outside `trained_steps`, which run as ODE).
    """

    prompt: str
    group_index: int
    sample_index: int
    seed: int
    latents: torch.Tensor  # [N + 1, *latent_shape], fp32
    sigmas: torch.Tensor  # [N + 1], fp32, from 1.0 down to 0.0
    log_probs: torch.Tensor  # [N], fp32
    trained_steps: list[int]
    cond: Conditioning  # batch of one, both prompt and negative prompt
    experts: list[str]  # [N] transformer component per step
    guidance_scales: list[float]  # [N]
    sde_type: str
    noise_level: float
    image: torch.Tensor  # [3, H, W] or [F, 3, H, W], float in [0, 1]
    model_outputs: torch.Tensor | None = None  # [N, *latent_shape] guided velocity, debug mode only
    metadata: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[0]
