import asyncio
import json
import shutil
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


def _forward_batch_sizes(scorer) -> list[int]:
    """Images per forward of the scorer's CLIP model, as they happen."""
    sizes: list[int] = []
    scorer.model.register_forward_pre_hook(lambda _, args, kwargs: sizes.append(len(kwargs["pixel_values"])),
                                           with_kwargs=True)
    return sizes


def test_pickscore_batch_size_sets_pairs_per_forward_and_leaves_the_scores(tiny_clip, make_args):
    rng = np.random.default_rng(1)
    samples = [RewardSample(prompt, rng.random((3, 40, 56)))
               for prompt in ("a red ball", "an owl", "a tall glass of milk on a wooden table", "snow", "a cat")]
    chunked_args = make_args(rm_type="pickscore", pickscore_model_path=str(tiny_clip), pickscore_batch_size=2)
    whole_args = make_args(rm_type="pickscore", pickscore_model_path=str(tiny_clip), pickscore_batch_size=8)
    chunked_sizes = _forward_batch_sizes(get_scorer(tiny_clip, batch_size=2))
    whole_sizes = _forward_batch_sizes(get_scorer(tiny_clip, batch_size=8))
    chunked = asyncio.run(score_samples(chunked_args, samples))
    whole = asyncio.run(score_samples(whole_args, samples))
    assert chunked_sizes == [2, 2, 1] and whole_sizes == [5]
    # Each pair's score is the same arithmetic in either batch; only the kernels' blocking (and the
    # text padding, masked out) can differ with the batch, which moves float32 sums by a few ulps
    # of their terms. Scores are at most 100 / SCORE_SCALE < 4, so 1e-5 is ~20 float32 ulps of the largest possible score (measured: 4.5e-8).
    assert np.allclose(chunked, whole, rtol=0.0, atol=1e-5)
    assert len(set(chunked)) == 5  # distinct scores: equality above compares something


def test_pickscore_processor_path_supplies_the_tokenizer_and_image_processor(tiny_clip, make_args, tmp_path):
    processor = tmp_path / "processor"
    processor.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_clip / name, processor / name)
    config = json.loads((tiny_clip / "preprocessor_config.json").read_text())
    config["image_mean"] = [0.1, 0.2, 0.3]  # another normalisation: images reach the model differently
    (processor / "preprocessor_config.json").write_text(json.dumps(config))
    # the same model folder with that processor in place: what scoring with the processor must equal
    combined = tmp_path / "combined"
    shutil.copytree(tiny_clip, combined)
    shutil.copy(processor / "preprocessor_config.json", combined / "preprocessor_config.json")

    samples = [RewardSample("a red ball", np.random.default_rng(2).random((3, 40, 56)))]
    args = make_args(rm_type="pickscore", pickscore_model_path=str(tiny_clip))
    own = asyncio.run(score_samples(args, samples))
    args.pickscore_processor_path = str(processor)
    other = asyncio.run(score_samples(args, samples))
    assert other != own
    assert other == asyncio.run(score_samples(make_args(rm_type="pickscore", pickscore_model_path=str(combined)),
                                              samples))
    assert get_scorer(tiny_clip, processor).processor_path == processor


def test_pickscore_processor_path_without_an_image_processor_is_a_named_error(tiny_clip, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--pickscore-processor-path .*preprocessor_config.json missing"):
        get_scorer(tiny_clip, tmp_path)
