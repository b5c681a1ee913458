"""Reward workers are sent only the frames they score, as uint8, and score them unchanged."""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import pytest

from miles.ray.reward_pool import wire_sample
from miles.rollout.rm_hub.pickscore import VIDEO_FRAMES, get_scorer, score_samples_with
from miles.rollout.rm_hub.types import RewardSample, frame_to_pil, pick_frames


def _video(frames: int = 9, side: int = 32, seed: int = 0) -> np.ndarray:
    # values a little outside [0, 1] too: the decoder's output is clipped on both paths
    return np.random.default_rng(seed).uniform(-0.05, 1.05, (frames, 3, side, side)).astype(np.float32)


def _pil_bytes(sample: RewardSample, count: int) -> list[bytes]:
    return [frame_to_pil(f).tobytes() for f in pick_frames(sample.frames(), count)]


@pytest.mark.parametrize("rm_type", ["pickscore", "ocr"])
def test_an_eight_bit_reward_gets_its_frames_as_uint8_and_reads_the_same_pixels(rm_type):
    sample = RewardSample("a cat", _video())
    wire = wire_sample(Namespace(rm_type=rm_type), sample)
    assert wire.image.dtype == np.uint8 and wire.image.shape == (VIDEO_FRAMES, 3, 32, 32) and wire.is_video
    assert wire.image.nbytes * 9 == sample.image.nbytes * VIDEO_FRAMES // 4  # 4 of 9 frames, 1 byte not 4
    assert _pil_bytes(wire, VIDEO_FRAMES) == _pil_bytes(sample, VIDEO_FRAMES)


def test_an_image_stays_one_frame_and_a_per_sample_reward_decides():
    image = RewardSample("a dog", _video(1)[0], {"rm_type": "pickscore"})
    wire = wire_sample(Namespace(rm_type="brightness"), image)
    assert wire.image.dtype == np.uint8 and wire.image.shape == (3, 32, 32) and not wire.is_video
    assert _pil_bytes(wire, 1) == _pil_bytes(image, 1)


def test_a_reward_reading_float_pixels_gets_every_frame_in_float32():
    sample = RewardSample("a cat", _video())
    wire = wire_sample(Namespace(rm_type="brightness"), sample)
    assert wire.image.dtype == np.float32 and np.array_equal(wire.image, sample.image)


def test_tiny_pickscore_scores_the_uint8_wire_exactly_as_the_float_video(model_cache_dir):
    from miles.proxy_assets.pickscore import ensure_tiny_pickscore

    scorer = get_scorer(ensure_tiny_pickscore(model_cache_dir))  # the one the e2e runs score with
    samples = [RewardSample(p, _video(seed=i)) for i, p in enumerate(["a red square", "a blue sky"])]
    wire = [wire_sample(Namespace(rm_type="pickscore"), s) for s in samples]
    assert score_samples_with(scorer, wire) == score_samples_with(scorer, samples)


def test_pickscore_num_frames_sets_the_frames_pickscore_is_sent_and_reads():
    from miles.rollout.rm_hub.pickscore import frames_scored

    sample = RewardSample("a cat", _video(9))
    wire = wire_sample(Namespace(rm_type="pickscore", pickscore_num_frames=2), sample)
    assert wire.image.shape == (2, 3, 32, 32)
    assert _pil_bytes(wire, 2) == _pil_bytes(sample, 2)  # the first and the last frame
    assert frames_scored(Namespace(pickscore_num_frames=8)) == 8 and frames_scored(Namespace()) == VIDEO_FRAMES
    assert wire_sample(Namespace(rm_type="ocr", pickscore_num_frames=2), sample).image.shape[0] == 4  # PickScore's only
