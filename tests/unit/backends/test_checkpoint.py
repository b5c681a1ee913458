import random

import pytest
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


def _names(root):
    return sorted(p.name for p in root.iterdir())


def test_keep_last_2_over_5_saves_leaves_exactly_the_last_2_and_latest(tmp_path):
    for rollout_id in range(5):
        ckpt.commit(_write(tmp_path, rollout_id, rollout_id), tmp_path, rollout_id, keep_last=2)
    assert _names(tmp_path) == ["latest", "rollout_000003", "rollout_000004"]
    assert ckpt.latest_checkpoint(tmp_path)[0] == 4


def test_keep_every_kth_is_kept_beside_the_last_n(tmp_path):
    for rollout_id in range(7):
        ckpt.commit(_write(tmp_path, rollout_id, rollout_id), tmp_path, rollout_id, keep_last=1, keep_every=3)
    # rollout counts 3 and 6 (ids 2 and 5) are multiples of 3; id 6 is the newest
    assert _names(tmp_path) == ["latest", "rollout_000002", "rollout_000005", "rollout_000006"]


def test_a_resave_of_the_latest_id_keeps_the_old_one_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    import os

    ckpt.commit(_write(tmp_path, 3, 3.0), tmp_path, 3)
    staging = _write(tmp_path, 3, 9.0)
    real_rename = os.rename

    def die_before_the_new_one_is_renamed_in(src, dst):
        if str(src) == str(staging):
            raise KeyboardInterrupt("killed here")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", die_before_the_new_one_is_renamed_in)
    with pytest.raises(KeyboardInterrupt):
        ckpt.commit(staging, tmp_path, 3)
    monkeypatch.setattr(os, "rename", real_rename)
    # the committed directory was only set aside: latest still reads it, whole
    rollout_id, path = ckpt.latest_checkpoint(tmp_path)
    assert rollout_id == 3 and ckpt.load_tensors(path / "model_transformer.safetensors")["w"].tolist() == [3.0, 3.0]
    ckpt.commit(_write(tmp_path, 3, 9.0), tmp_path, 3)  # the re-save goes through next time
    rollout_id, path = ckpt.latest_checkpoint(tmp_path)
    assert path.name == "rollout_000003" and ckpt.load_tensors(path / "model_transformer.safetensors")["w"][0] == 9.0
    assert _names(tmp_path) == ["latest", "rollout_000003"]


def test_commit_fsyncs_every_file_the_latest_pointer_and_the_directories(tmp_path, monkeypatch):
    import os

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    final = ckpt.commit(_write(tmp_path, 1, 1.0), tmp_path, 1)
    staging = str(tmp_path / ".staging_rollout_000001")
    assert {f"{staging}/trainer.json", f"{staging}/model_transformer.safetensors", staging} <= set(synced)
    assert str(tmp_path / ".latest.tmp") in synced and synced[-1] == str(tmp_path)  # the renames, last
    assert final.is_dir()
