import random

import torch

from miles.backends import checkpoint as ckpt


def _write(root, rollout_id, value):
    staging = ckpt.staging_dir(root, rollout_id)
    (staging / "trainer.json").write_text(f'{{"rollout_id": {rollout_id}}}')
    ckpt.save_tensors(staging / "model_transformer.safetensors", {"w": torch.full((2,), float(value))})
    return staging


def test_commit_makes_the_checkpoint_the_latest(tmp_path):
    ckpt.commit(_write(tmp_path, 3, 3.0), tmp_path, 3)
    rollout_id, path = ckpt.latest_checkpoint(tmp_path)
    assert rollout_id == 3 and path.name == "rollout_000003"
    assert ckpt.load_tensors(path / "model_transformer.safetensors")["w"].tolist() == [3.0, 3.0]


def test_a_save_killed_before_commit_leaves_the_previous_checkpoint_whole(tmp_path):
    ckpt.commit(_write(tmp_path, 3, 3.0), tmp_path, 3)
    _write(tmp_path, 5, 5.0)  # staged, never committed: the process died here
    rollout_id, path = ckpt.latest_checkpoint(tmp_path)
    assert rollout_id == 3
    assert ckpt.load_tensors(path / "model_transformer.safetensors")["w"].tolist() == [3.0, 3.0]
    # the next save of the same id starts over from a clean staging dir
    ckpt.commit(_write(tmp_path, 5, 6.0), tmp_path, 5)
    assert ckpt.latest_checkpoint(tmp_path)[0] == 5


def test_no_checkpoint_reads_as_none(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_rng_state_round_trips():
    state = ckpt.rng_state()
    first = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state)
    again = (random.random(), torch.rand(3))
    assert first[0] == again[0] and torch.equal(first[1], again[1])
