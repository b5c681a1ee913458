import asyncio

import numpy as np
import pytest

from miles.rollout.rm_hub import RewardError, RewardSample, score_samples


def _samples(*prompts, metadata=None):
    return [RewardSample(p, np.full((3, 4, 4), 0.5, dtype=np.float32), dict(metadata or {})) for p in prompts]


def _score(args, samples, **kw):
    return asyncio.run(score_samples(args, samples, **kw))


def test_metadata_rm_type_overrides_the_flag_per_sample(make_args):
    samples = _samples("a red x") + _samples("a red y", metadata={"rm_type": "color_match"})
    scores = _score(make_args(rm_type="brightness"), samples)
    # brightness of mid gray: 0.5 is exact in fp32 and so is every partial sum of 16 of them
    assert scores[0] == pytest.approx(0.5, abs=1e-12)
    assert scores[1] == pytest.approx(1 - np.linalg.norm([0.5, 0.5, 0.5]) / np.sqrt(3))


def test_custom_reward_is_used_when_no_rm_type(custom_module, make_args):
    for path in (f"{custom_module}:sync_constant", f"{custom_module}.sync_constant"):
        assert _score(make_args(custom_rm_path=path), _samples("a", "b")) == [0.25, 0.25]


def test_custom_reward_that_raises_names_reward_and_failing_sample(custom_module, make_args):
    args = make_args(custom_rm_path=f"{custom_module}:raises")
    with pytest.raises(RewardError, match=r"--custom-rm-path my_rewards:raises raised ValueError: cannot "
                                          r"read this one on sample 12 \(prompt 'a bad one'\); fix: that function"):
        _score(args, _samples("fine", "a bad one", "fine"), first_index=11)


def test_nan_reward_names_reward_and_sample(custom_module, make_args):
    with pytest.raises(RewardError, match=r"my_rewards:returns_nan returned nan for sample 2 \(prompt 'bad'\); fix: "):
        _score(make_args(custom_rm_path=f"{custom_module}:returns_nan"), _samples("a", "b", "bad"))


def test_wrong_number_of_values_names_reward_and_samples(custom_module, make_args):
    with pytest.raises(RewardError, match=r"my_rewards:too_few returned 2 values for 3 samples.*prompt 'a'.*; fix: return one score per "):
        _score(make_args(custom_rm_path=f"{custom_module}:too_few"), _samples("a", "b", "c"))


def test_a_custom_reward_returning_a_float_names_the_flag_the_path_and_what_it_must_return(custom_module,
                                                                                           make_args):
    """The custom loss's form (miles.utils.dotted_path): `<flag> <path> returned a <type>; fix: return ...`."""
    with pytest.raises(RewardError) as refused:
        _score(make_args(custom_rm_path=f"{custom_module}:returns_float"), _samples("a", "b"))
    assert str(refused.value) == (
        "--custom-rm-path my_rewards:returns_float returned a float (samples 0..1, first: sample 0 (prompt 'a')); "
        "fix: return one score per sample, in order: a list of floats (`async def rm(args, samples) -> list[float]`)")


def test_reward_key_selects_from_dict_results(custom_module, make_args):
    args = make_args(custom_rm_path=f"{custom_module}:prompt_length", reward_key="len")
    assert _score(args, _samples("ab", "abcd")) == [2.0, 4.0]
    with pytest.raises(RewardError, match="--reward-key"):
        _score(make_args(custom_rm_path=f"{custom_module}:prompt_length"), _samples("ab"))


def test_unknown_reward_and_missing_configuration_are_errors(custom_module, make_args):
    with pytest.raises(RewardError, match=r"unknown reward 'nope'.*sample 0"):
        _score(make_args(rm_type="nope"), _samples("a"))
    with pytest.raises(RewardError, match="pass --rm-type or --custom-rm-path"):
        _score(make_args(), _samples("a"))
    with pytest.raises(RewardError, match="has no function 'missing'"):
        _score(make_args(custom_rm_path=f"{custom_module}:missing"), _samples("a"))


def test_timeout_names_the_reward(tmp_path, monkeypatch, make_args):
    (tmp_path / "slow_rm.py").write_text("import asyncio\nasync def rm(args, samples):\n"
                                         "    await asyncio.sleep(5)\n    return [0.0] * len(samples)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"--custom-rm-path slow_rm:rm timed out after 0.05s.*fix: "):
        _score(make_args(custom_rm_path="slow_rm:rm", reward_timeout=0.05), _samples("a"))
