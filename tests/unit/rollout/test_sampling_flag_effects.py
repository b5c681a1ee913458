"""Sampling flags observed in what an engine built from the parsed flags samples (tiny sd3, in process).

The same requests (same seeds, so the same initial noise and SDE noise) are sampled under two values
of one flag; what differs is that flag's doing. `python3 -m tests.tools.mutation_check` makes each
flag a no-op in the source and shows these tests failing.
"""

from __future__ import annotations

import pytest
import torch

from miles.rollout.engine import RolloutEngine
from miles.rollout.types import SampleRequest
from miles.flags.arguments import parse_args

REQUESTS = [SampleRequest("a red cat", 0, i, 100 + i) for i in range(2)]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint()


def sample(checkpoint, flags: str):
    argv = (f"--hf-checkpoint {checkpoint} --num-rollout 1 --rm-type brightness --prompt-data p.jsonl --device cpu "
            f"--diffusion-num-steps 3 --diffusion-height 32 --diffusion-width 32 {flags}")
    engine = RolloutEngine.from_args(parse_args(argv.split()), num_threads=1)
    return engine.generate(REQUESTS, [0, 1])


def test_noise_level_sets_how_far_the_sde_steps_stray_from_the_ode_step(checkpoint):
    # noise level 0 is the ODE step; the first step's velocity is the same for every level (same
    # start), so the distance from the ODE sample grows with the level
    distance = {}
    for level in (0.0, 0.5, 1.2):
        trajectories = sample(checkpoint, f"--diffusion-noise-level {level}")
        assert {t.noise_level for t in trajectories} == {level}
        distance[level] = torch.stack([t.latents[1] for t in trajectories])
    ode = distance.pop(0.0)
    spread = {level: float((x - ode).norm()) for level, x in distance.items()}
    assert 0.0 < spread[0.5] < spread[1.2]


def test_guidance_scale_mixes_the_unconditional_velocity_into_every_step(checkpoint):
    plain = sample(checkpoint, "--diffusion-guidance-scale 1.0")
    guided = sample(checkpoint, "--diffusion-guidance-scale 4.0")
    assert {s for t in guided for s in t.guidance_scales} == {4.0}
    for p, g in zip(plain, guided):
        assert torch.equal(p.latents[0], g.latents[0])  # the same start
        assert not torch.equal(p.latents[-1], g.latents[-1])
