"""Eval prompts are held out from the training prompts: loading the training prompts refuses an
overlap, naming both files and one shared prompt."""

import json
from types import SimpleNamespace

import pytest

from miles.rollout.data import PromptDataError, PromptDataset


def _write(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def _args(train, held_out, eval_interval=2):
    return SimpleNamespace(prompt_data=train, eval_prompt_data=held_out, eval_interval=eval_interval,
                           input_key="prompt", metadata_key="metadata", rollout_seed=1, rollout_shuffle=False)


def test_an_eval_prompt_that_is_a_training_prompt_is_refused_naming_both_files(tmp_path):
    train = _write(tmp_path / "train.jsonl", ["a cat", "a dog", "a red sign"])
    held_out = _write(tmp_path / "test.jsonl", ["a blue sign", "a dog"])
    with pytest.raises(PromptDataError) as refused:
        PromptDataset.from_args(_args(train, held_out))
    message = str(refused.value)
    assert train in message and held_out in message and "'a dog'" in message and "1 of the 2" in message


def test_disjoint_prompts_load_and_a_run_without_eval_is_not_checked(tmp_path):
    train = _write(tmp_path / "train.jsonl", ["a cat", "a dog"])
    assert len(PromptDataset.from_args(_args(train, _write(tmp_path / "t.jsonl", ["a bird"]))).items) == 2
    assert len(PromptDataset.from_args(_args(train, _write(tmp_path / "u.jsonl", ["a cat"]), None)).items) == 2


def test_the_training_file_itself_as_eval_prompts_is_refused(tmp_path):
    train = _write(tmp_path / "train.jsonl", ["a cat"])
    with pytest.raises(PromptDataError, match="is the training prompt file"):
        PromptDataset.from_args(_args(train, train))
