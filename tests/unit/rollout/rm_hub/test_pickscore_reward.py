import asyncio
import hashlib

import numpy as np
import pytest

from miles.rollout.rm_hub import RewardError, RewardSample, score_samples
from miles.proxy_assets.pickscore import ensure_tiny_pickscore
from miles.rollout.rm_hub.pickscore import SCORE_SCALE, get_scorer


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return ensure_tiny_pickscore(tmp_path_factory.mktemp("clip"), seed=0)


def test_tiny_pickscore_is_byte_identical_per_seed(tmp_path, tiny_clip):
    again = ensure_tiny_pickscore(tmp_path / "again", seed=0)
    other = ensure_tiny_pickscore(tmp_path / "other", seed=1)
    assert _digests(again) == _digests(tiny_clip)
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= set(_digests(again))
    assert _digests(other)["model.safetensors"] != _digests(tiny_clip)["model.safetensors"]
    assert not [p.name for p in (tmp_path / "again").iterdir() if ".tmp-" in p.name]  # no half-built copy left


def test_tiny_tokenizer_knows_prompt_words(tiny_clip):
    tokenizer = get_scorer(tiny_clip).tokenizer
    ids = tokenizer("a Red sign that says HELLO").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids


def test_pickscore_scores_are_finite_deterministic_and_depend_on_image_and_prompt(tiny_clip, make_args):
    rng = np.random.default_rng(0)
    image, other = rng.random((3, 40, 56)), rng.random((3, 40, 56))
    video = rng.random((3, 3, 40, 56))
    args = make_args(rm_type="pickscore", pickscore_model_path=str(tiny_clip))
    samples = [RewardSample("a red ball", image), RewardSample("a red ball", other),
               RewardSample("a snowy owl at sunrise", image), RewardSample("a red ball", video)]
    first = asyncio.run(score_samples(args, samples))
    second = asyncio.run(score_samples(args, samples))
    assert first == second
    assert all(np.isfinite(first)) and all(abs(s) <= 100.0 / SCORE_SCALE for s in first)
    assert len(set(first)) == 4


def test_pickscore_without_model_path_is_a_named_error(make_args):
    with pytest.raises(RewardError, match=r"'pickscore'.*--pickscore-model-path.*sample 0"):
        asyncio.run(score_samples(make_args(rm_type="pickscore"), [RewardSample("x", np.zeros((3, 8, 8)))]))
