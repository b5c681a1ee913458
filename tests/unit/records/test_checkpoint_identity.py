"""Issue 27 point 1: a checkpoint knows its run; --load and --save are checked against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.records import checkpoint_identity as identity
from miles.flags.arguments import parse_and_plan

BASE = ("--hf-checkpoint /ckpt/sd3-tiny --prompt-data p.jsonl --num-rollout 2 --rm-type brightness "
        "--rollout-batch-size 4 --n-samples-per-prompt 2 --num-gpus-per-node 1 --colocate --device cpu --rollout-shuffle")


def args(run_dir: Path, extra: str = ""):
    return parse_and_plan([*BASE.split(), "--run-dir", str(run_dir), *extra.split()])[0]


def commit(save: Path, ns, rollout_id: int, offset: int = 4) -> Path:
    """A committed checkpoint directory as the trainer writes it (its record; weights do not matter here)."""
    path = save / f"rollout_{rollout_id:06d}"
    path.mkdir(parents=True)
    order = {"epoch": 0, "offset": offset, "seed": ns.rollout_seed, "shuffle": ns.rollout_shuffle, "num_prompts": 8}
    (path / identity.RECORD).write_text(json.dumps(identity.checkpoint_record(ns, rollout_id, order, "wb-1")))
    (save / "latest").write_text(path.name + "\n")
    return path


def test_a_checkpoint_records_run_id_flag_hash_data_order_and_code_version(tmp_path):
    ns = args(tmp_path / "run-a")
    record = json.loads((commit(tmp_path / "ckpt", ns, 3) / identity.RECORD).read_text())
    assert record["run_id"] == "run-a" and record["rollout_id"] == 3
    assert record["training_flags"]["lr"] == ns.lr and set(record["training_flags"]) == set(identity.TRAINING_FLAGS)
    assert record["training_flags_hash"] == identity.flags_hash(identity.training_flags(ns))
    assert record["data_order"] == {"epoch": 0, "offset": 4, "seed": 42, "shuffle": True, "num_prompts": 8}
    assert record["code_version"] and record["wandb_run_id"] == "wb-1"
    # the hash moves with a training flag and not with a path or the run length
    assert identity.flags_hash(identity.training_flags(args(tmp_path / "b", "--lr 2e-4"))) != record["training_flags_hash"]
    same = args(tmp_path / "c", "--num-rollout 9 --save-interval 1 --save /x")
    assert identity.flags_hash(identity.training_flags(same)) == record["training_flags_hash"]


def test_a_save_dir_holding_another_runs_checkpoints_is_refused_whatever_load_says(tmp_path):
    save = tmp_path / "ckpt"
    commit(save, args(tmp_path / "theirs"), 0)
    ours = args(tmp_path / "ours", f"--save {save} --load {save}")
    with pytest.raises(identity.CheckpointRefused, match=r"holds checkpoints of another run \(theirs: 1 checkpoint"):
        identity.check_run_checkpoints(ours)


def test_own_checkpoints_need_load_and_a_new_save_dir_needs_nothing(tmp_path):
    save = tmp_path / "ckpt"
    commit(save, args(tmp_path / "run"), 0)
    with pytest.raises(identity.CheckpointRefused, match="already holds committed checkpoints .* add --load"):
        identity.check_run_checkpoints(args(tmp_path / "run", f"--save {save}"))
    found = identity.check_run_checkpoints(args(tmp_path / "run", f"--save {save} --load {save}"))
    assert found.checkpoint.rollout_id == 0 and found.differences == []
    assert identity.check_run_checkpoints(args(tmp_path / "run", f"--save {tmp_path / 'new'}")).checkpoint is None


def test_a_load_without_a_checkpoint_names_what_was_looked_for(tmp_path):
    with pytest.raises(identity.CheckpointRefused, match=f"--load {tmp_path}/gone: no such directory .*gone/latest"):
        identity.check_load(args(tmp_path / "r", f"--load {tmp_path}/gone"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(identity.CheckpointRefused, match="holds no committed checkpoint .*empty/latest is missing"):
        identity.check_load(args(tmp_path / "r", f"--load {tmp_path}/empty"))


def test_a_load_with_other_training_flags_names_each_one_unless_load_anyway(tmp_path):
    save = tmp_path / "ckpt"
    commit(save, args(tmp_path / "a"), 0)
    other = f"--load {save} --lr 5e-4 --adam-beta1 0.8"
    with pytest.raises(identity.CheckpointRefused) as refused:
        identity.check_load(args(tmp_path / "b", other))
    message = str(refused.value)
    assert "--lr 0.0005 (checkpoint: 0.0001)" in message and "--adam-beta1 0.8 (checkpoint: 0.9)" in message
    assert message.count("(checkpoint:") == 2 and "--load-anyway" in message
    accepted = identity.check_load(args(tmp_path / "b", other + " --load-anyway"))
    assert accepted.differences == ["--lr 0.0005 (checkpoint: 0.0001)", "--adam-beta1 0.8 (checkpoint: 0.9)"]


def test_the_data_order_comes_from_the_checkpoint_and_a_conflicting_seed_is_an_error(tmp_path):
    save = tmp_path / "ckpt"
    commit(save, args(tmp_path / "a"), 0, offset=4)
    with pytest.raises(identity.CheckpointRefused, match=r"--rollout-seed 7 \(checkpoint: 42\)"):
        identity.check_load(args(tmp_path / "b", f"--load {save} --rollout-seed 7 --load-anyway"))
    with pytest.raises(identity.CheckpointRefused, match=r"--no-rollout-shuffle \(checkpoint: on\)"):
        identity.check_load(args(tmp_path / "b", f"--load {save} --no-rollout-shuffle"))
    found = identity.check_load(args(tmp_path / "b", f"--load {save}")).checkpoint
    assert identity.data_order_line(found) == ("data order: restored from rollout_000000: seed 42, shuffle on, "
                                               "epoch 0, next item 4 of 8")


def test_a_checkpoint_without_a_record_of_its_flags_is_loaded_only_anyway(tmp_path):
    save = tmp_path / "ckpt"
    (save / "rollout_000002").mkdir(parents=True)
    (save / "rollout_000002" / identity.RECORD).write_text('{"rollout_id": 2}')
    (save / "latest").write_text("rollout_000002\n")
    with pytest.raises(identity.CheckpointRefused, match="records no training flags"):
        identity.check_load(args(tmp_path / "r", f"--load {save}"))
    assert identity.check_load(args(tmp_path / "r", f"--load {save} --load-anyway")).checkpoint.rollout_id == 2


@pytest.mark.parametrize("argv,message", [
    ("--keep-last 2", "--keep-last 2 needs --save"),
    ("--save /s --keep-every 3", "--keep-every 3 needs --keep-last"),
    ("--load-anyway", "--load-anyway needs --load"),
])
def test_retention_and_load_anyway_flags_without_what_they_act_on_are_refused_at_parse_time(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        args(tmp_path / "r", argv)
