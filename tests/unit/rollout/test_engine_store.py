"""What an engine keeps of a sample in a run (miles.rollout.engine_store), with a `put` that pickles:
a trained sample's trajectory is a fraction of its whole path, its conditioning is put once per
prompt group, an eval keeps only what its reward reads, a thumbnail is small."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from miles.rollout.engine_store import THUMBNAIL_SIDE, SampleStore, thumbnail
from miles.rollout.types import Conditioning, SampleRequest, Trajectory

STEPS, SHAPE = 10, (16, 2, 8, 8)  # a video latent: channels, frames, height, width


def _trajectory(group: int, sample: int, frames: int = 9) -> Trajectory:
    g = torch.Generator().manual_seed(100 * group + sample)
    cond = Conditioning({"encoder_hidden_states": torch.randn(1, 12, 32, generator=g)},
                        {"encoder_hidden_states": torch.zeros(1, 12, 32)})
    return Trajectory(f"prompt {group}", group, sample, sample, torch.randn(STEPS + 1, *SHAPE, generator=g),
                      torch.linspace(1, 0, STEPS + 1), torch.randn(STEPS, generator=g), [3, 4], cond,
                      ["transformer"] * STEPS, [4.0] * STEPS, "sde", 0.7,
                      torch.rand(frames, 3, 48, 80, generator=g), torch.randn(STEPS, *SHAPE, generator=g))


class PickleStore:
    """Ray's object store as a list of pickled values: a reference is an index."""

    def __init__(self):
        self.blobs: list[bytes] = []

    def put(self, value) -> int:
        self.blobs.append(pickle.dumps(value))
        return len(self.blobs) - 1

    def get(self, ref: int):
        return pickle.loads(self.blobs[ref])


def _request(t: Trajectory, **kw) -> SampleRequest:
    return SampleRequest(t.prompt, t.group_index, t.sample_index, t.seed, **kw)


def test_a_trained_sample_keeps_its_trained_steps_the_probed_outputs_and_nothing_else():
    store, t = PickleStore(), _trajectory(0, 0)
    [stored] = SampleStore(store.put, train=True).keep([_request(t, output_steps=(4,), reward_frames=4)], [t])
    kept = store.get(stored.trajectory)
    assert kept.latent_steps == [3, 4, 5, STEPS] and kept.output_steps == [4]
    assert all(torch.equal(kept.latent(k), t.latents[k]) for k in kept.latent_steps)
    assert torch.equal(kept.latent(-1), t.latents[-1]) and torch.equal(kept.model_output(4), t.model_outputs[4])
    assert kept.model_output(3) is None and kept.image is None and kept.cond is None
    with pytest.raises(KeyError, match="step 0 was not kept"):
        kept.latent(0)
    # 4 of 11 latents and 1 of 10 outputs, no pixels: under a fifth of the whole path's bytes
    assert len(store.blobs[stored.trajectory]) < 0.2 * len(pickle.dumps(t))
    reward = store.get(stored.reward_input)
    assert reward.image.dtype == np.uint8 and reward.image.shape == (4, 3, 48, 80)  # 4 of 9 frames


def test_a_groups_conditioning_is_put_once_and_an_eval_keeps_only_what_its_reward_reads():
    store = PickleStore()
    group = [_trajectory(0, j) for j in range(3)]
    for t in group[1:]:
        t.cond = group[0].cond
    stored = SampleStore(store.put, train=True).keep([_request(t) for t in group], group)
    assert len({s.cond for s in stored}) == 1
    assert torch.equal(store.get(stored[0].cond).positive["encoder_hidden_states"],
                       group[0].cond.positive["encoder_hidden_states"])
    evaluated = SampleStore(store.put, train=False).keep([_request(group[0])], group[:1])[0]
    assert evaluated.trajectory is None and evaluated.cond is None
    assert store.get(evaluated.reward_input).image.dtype == np.float32  # reward_frames 0: every frame as decoded
    stranger = _trajectory(1, 0)
    with pytest.raises(ValueError, match="two prompts"):  # a group is one prompt's samples
        SampleStore(store.put, train=True).keep([_request(group[0]), SampleRequest(stranger.prompt, 0, 1, 1)],
                                                [group[0], stranger])


def test_a_thumbnail_is_the_first_frame_at_most_its_side_and_keeps_the_aspect():
    video = torch.rand(5, 3, 480, 832)
    small = thumbnail(video)
    assert small.dtype == np.uint8 and small.shape == (3, 74, THUMBNAIL_SIDE)
    assert abs(float(small.mean()) / 255 - float(video[0].mean())) < 0.01  # area average: the mean is kept
    assert thumbnail(torch.rand(3, 32, 32)).shape == (3, 32, 32)  # small images as they are


def test_the_host_plan_counts_the_thumbnails_the_driver_keeps():
    from miles.ray.rollout_manager import THUMBNAILS, thumbnail_samples
    from miles.plan.host_plan import THUMBNAIL_BYTES

    assert THUMBNAIL_BYTES == THUMBNAILS * 3 * THUMBNAIL_SIDE ** 2
    # the first sample of every prompt, then the second...: 16 of 16 x 16, 4 of 2 x 2
    assert thumbnail_samples(16, 16) == {g * 16 for g in range(16)}
    assert thumbnail_samples(2, 2) == {0, 1, 2, 3}
