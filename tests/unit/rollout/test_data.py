import json

import pytest

from miles.rollout.data import PromptDataError, PromptDataset, read_prompt_file


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _records(n):
    return [json.dumps({"prompt": f"p{i}", "metadata": {"i": i}}) for i in range(n)]


def test_reads_prompts_and_metadata_with_custom_keys(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"text": "a cat", "meta": {"rm_type": "ocr"}}), "",
                                         json.dumps({"text": "a dog"})])
    items = read_prompt_file(path, input_key="text", metadata_key="meta")
    assert [(i.prompt, i.metadata, i.index) for i in items] == [("a cat", {"rm_type": "ocr"}, 0), ("a dog", {}, 1)]


def test_malformed_line_error_names_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.jsonl", _records(2) + ['{"prompt": "x",'])
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:3: malformed JSON"):
        read_prompt_file(path)


def test_missing_input_key_error_names_file_line_and_key(tmp_path):
    path = _write(tmp_path / "d.jsonl", _records(1) + [json.dumps({"caption": "x"})])
    with pytest.raises(PromptDataError, match=r"d\.jsonl:2: missing input key 'prompt'"):
        read_prompt_file(path)


def test_non_object_metadata_is_an_error(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "x", "metadata": [1]})])
    with pytest.raises(PromptDataError, match=r"d\.jsonl:1: 'metadata' must be an object"):
        read_prompt_file(path)


def test_missing_file_and_empty_file_are_errors(tmp_path):
    with pytest.raises(PromptDataError, match="not found"):
        read_prompt_file(tmp_path / "nope.jsonl")
    with pytest.raises(PromptDataError, match="no prompts"):
        read_prompt_file(_write(tmp_path / "e.jsonl", [""]))


def test_batches_cross_epochs_in_file_order_without_shuffle(tmp_path):
    ds = PromptDataset.from_jsonl(_write(tmp_path / "d.jsonl", _records(5)))
    batches = [[i.prompt for i in ds.next_batch(3)] for _ in range(3)]
    assert batches == [["p0", "p1", "p2"], ["p3", "p4", "p0"], ["p1", "p2", "p3"]]
    assert ds.epoch == 1


def test_shuffle_is_deterministic_per_seed_and_differs_between_epochs(tmp_path):
    path = _write(tmp_path / "d.jsonl", _records(50))
    a = PromptDataset.from_jsonl(path, seed=7, shuffle=True)
    b = PromptDataset.from_jsonl(path, seed=7, shuffle=True)
    c = PromptDataset.from_jsonl(path, seed=8, shuffle=True)
    assert a.epoch_order(0) == b.epoch_order(0)
    assert a.epoch_order(0) != c.epoch_order(0)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert sorted(a.epoch_order(1)) == list(range(50))
    assert [i.index for i in a.next_batch(50)] == a.epoch_order(0)


def test_state_dict_resume_continues_with_the_same_prompts(tmp_path):
    path = _write(tmp_path / "d.jsonl", _records(7))
    ref = PromptDataset.from_jsonl(path, seed=3, shuffle=True)
    for _ in range(3):
        ref.next_batch(4)
    state = ref.state_dict()
    expected = [[i.index for i in ref.next_batch(4)] for _ in range(4)]

    resumed = PromptDataset.from_jsonl(path, seed=3, shuffle=True)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [[i.index for i in resumed.next_batch(4)] for _ in range(4)] == expected


def test_load_state_dict_rejects_a_changed_file(tmp_path):
    ds = PromptDataset.from_jsonl(_write(tmp_path / "d.jsonl", _records(4)))
    with pytest.raises(PromptDataError, match="saved with 9 prompts"):
        ds.load_state_dict({"epoch": 0, "offset": 0, "num_prompts": 9})


def test_from_args_reads_the_trainer_flags(tmp_path):
    from argparse import Namespace

    path = _write(tmp_path / "d.jsonl", [json.dumps({"q": "hi", "m": {"k": 1}})])
    args = Namespace(prompt_data=str(path), input_key="q", metadata_key="m", rollout_seed=1, rollout_shuffle=True)
    ds = PromptDataset.from_args(args)
    assert (ds[0].prompt, ds[0].metadata, ds.shuffle, ds.seed) == ("hi", {"k": 1}, True, 1)
