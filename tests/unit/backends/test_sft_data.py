"""The SFT data reader: seeded order, epochs, resume from state_dict, pixels from PNG frame strips."""

import json

import pytest
import torch

from miles.backends.sft_data import SFTDataError, SFTDataset, load_pixels, read_sft_file
from miles.proxy_assets.prompts import ensure_sft_dataset


@pytest.fixture(scope="module")
def image_set(tmp_path_factory):
    return ensure_sft_dataset(tmp_path_factory.mktemp("sft") / "img.jsonl", "sd3", 10, 16, 24, 1)


@pytest.fixture(scope="module")
def video_set(tmp_path_factory):
    return ensure_sft_dataset(tmp_path_factory.mktemp("sft") / "vid.jsonl", "wan2_2", 3, 8, 12, 5)


def _walk(dataset, batches, size):
    return [[item.index for item in dataset.next_batch(size)] for _ in range(batches)]


def test_order_is_fixed_by_the_seed_and_covers_each_epoch(image_set):
    items = read_sft_file(image_set)
    a = _walk(SFTDataset(items, seed=7, shuffle=True), 5, 4)
    assert a == _walk(SFTDataset(items, seed=7, shuffle=True), 5, 4)
    assert a != _walk(SFTDataset(items, seed=8, shuffle=True), 5, 4)
    flat = [i for batch in a for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # epochs 0 and 1
    assert flat[:10] != flat[10:20]  # each epoch has its own order
    assert _walk(SFTDataset(items, shuffle=False), 3, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_resume_from_state_dict_draws_what_an_uninterrupted_run_draws(image_set):
    items = read_sft_file(image_set)
    straight = _walk(SFTDataset(items, seed=3, shuffle=True), 7, 3)
    first = SFTDataset(items, seed=3, shuffle=True)
    head = _walk(first, 4, 3)  # stops mid-epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = SFTDataset(items, seed=999, shuffle=False)  # the state carries seed and shuffle
    resumed.load_state_dict(state)
    assert head + _walk(resumed, 3, 3) == straight
    with pytest.raises(SFTDataError, match="items"):
        SFTDataset(items[:5]).load_state_dict(state)


def test_from_args_uses_the_rollout_seed(image_set):
    class Args:
        prompt_data, input_key, rollout_seed, rollout_shuffle = str(image_set), "prompt", 11, True

    assert _walk(SFTDataset.from_args(Args), 2, 5) == _walk(SFTDataset(read_sft_file(image_set), seed=11), 2, 5)


def test_image_pixels(image_set):
    item = read_sft_file(image_set)[0]
    assert item.prompt.startswith("a ") and item.media.endswith(".png")
    pixels = load_pixels(item, is_video=False)
    assert pixels.shape == (3, 16, 24) and pixels.dtype == torch.float32
    assert 0 <= pixels.min() and pixels.max() <= 1 and pixels.std() > 0


def test_video_pixels_split_the_frame_strip(video_set):
    from PIL import Image
    import numpy as np

    item = read_sft_file(video_set)[0]
    video = load_pixels(item, is_video=True)
    assert video.shape == (5, 3, 8, 12)
    strip = torch.from_numpy(np.asarray(Image.open(item.media).convert("RGB")).copy()).float() / 255
    for f in range(5):
        assert torch.equal(video[f], strip[:, f * 12:(f + 1) * 12].permute(2, 0, 1))
    assert not torch.equal(video[0], video[2])  # the gradient drifts


def test_bad_files_name_the_problem(tmp_path, image_set):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "media": "a.png"}\n')
    with pytest.raises(SFTDataError, match="bad.jsonl:1: missing height, width"):
        read_sft_file(bad)
    item = read_sft_file(image_set)[0]
    wrong = item.__class__(item.prompt, item.media, 16, 12, 1, 0)
    with pytest.raises(SFTDataError, match="expected"):
        load_pixels(wrong, is_video=False)
