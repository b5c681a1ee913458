import asyncio

import numpy as np
import pytest
import torch

from miles.rollout.rm_hub import RewardError, RewardSample, score_samples


def _solid(rgb, h=8, w=8):
    return np.broadcast_to(np.asarray(rgb, dtype=np.float32)[:, None, None], (3, h, w)).copy()


def _score(args, samples):
    return asyncio.run(score_samples(args, samples))


def test_brightness_ranks_bright_above_dark_for_numpy_torch_and_video(make_args):
    samples = [RewardSample("x", _solid((0.9, 0.9, 0.9))), RewardSample("x", torch.full((3, 8, 8), 0.1)),
               RewardSample("x", torch.full((2, 3, 8, 8), 0.5, dtype=torch.bfloat16))]
    bright, dark, video = _score(make_args(rm_type="brightness"), samples)
    assert bright > video > dark
    # a channel's mean over n = 64 equal fp32 values is within n u of the value whatever the summation
    # order (recursive summation's bound; numpy's pairwise sum is tighter), the value itself within
    # u of 0.9 or 0.1, and the luminance weights sum to 1 in float64
    n, u = 8 * 8, 2.0 ** -24
    assert bright == pytest.approx(0.9, abs=(n + 1) * u * 0.9) and dark == pytest.approx(0.1, abs=(n + 1) * u * 0.1)


def test_color_match_ranks_red_above_blue_for_a_red_prompt(make_args):
    args = make_args(rm_type="color_match")
    red, blue = _score(args, [RewardSample("a red ball", _solid((1, 0, 0))), RewardSample("a red ball", _solid((0, 0, 1)))])
    assert red == pytest.approx(1.0) and blue < 0.5


def test_color_match_prefers_metadata_colour_over_prompt_words(make_args):
    sample = RewardSample("a red ball", _solid((0, 0, 1)), {"color": "blue"})
    assert _score(make_args(rm_type="color_match"), [sample]) == [pytest.approx(1.0)]


def test_color_match_without_a_colour_names_the_sample(make_args):
    with pytest.raises(RewardError, match=r"'color_match'.*sample 1 \(prompt 'a ball'\)"):
        _score(make_args(rm_type="color_match"), [RewardSample("a red ball", _solid((1, 0, 0))),
                                                  RewardSample("a ball", _solid((1, 0, 0)))])


def test_bad_image_shape_names_the_sample(make_args):
    with pytest.raises(RewardError, match=r"'brightness'.*shape.*sample 0"):
        _score(make_args(rm_type="brightness"), [RewardSample("p", np.zeros((8, 8, 3)))])
