"""The driver's background save (miles.ray.checkpoint_saver): `latest` moves only once every
rank's write has ended, never while a write is pending, and the next save waits for the last."""

from __future__ import annotations

import threading
from pathlib import Path
from argparse import Namespace

import pytest

from miles.backends.checkpoint import checkpoint_name, latest_checkpoint
from miles.ray.checkpoint_saver import CheckpointSaver


class HeldWriter:
    """Train ranks whose background write ends when the test releases it."""

    def __init__(self):
        self.release = threading.Event()
        self.thread = None

    def begin_save(self, staging: str) -> None:
        def write():
            self.release.wait(30)
            (Path(staging) / "model.bin").write_bytes(b"w")

        self.thread = threading.Thread(target=write)
        self.thread.start()

    def save_done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def finish_save(self) -> None:
        if self.thread is not None:
            self.release.set()
            self.thread.join()
            self.thread = None


def saver_at(tmp_path, trainer) -> tuple[CheckpointSaver, list[str]]:
    lines: list[str] = []
    return CheckpointSaver(Namespace(save=str(tmp_path), keep_last=None, keep_every=None), trainer, lines.append), lines


def test_latest_moves_only_after_every_rank_has_written_the_save(tmp_path):
    trainer = HeldWriter()
    saver, lines = saver_at(tmp_path, trainer)
    saver.start(0, {"rollout": {}}, {"rollout_id": 0})
    saver.poll()  # the write is held: nothing is committed, training would go on here
    assert latest_checkpoint(tmp_path) is None and not (tmp_path / checkpoint_name(0)).exists()
    trainer.release.set()
    trainer.thread.join()
    saver.poll()
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == 0 and (found[1] / "model.bin").read_bytes() == b"w"
    assert (found[1] / "driver.pt").exists() and lines and lines[0].startswith(f"saved checkpoint {found[1]}")


def test_the_next_save_and_the_runs_end_wait_for_the_pending_one(tmp_path):
    trainer = HeldWriter()
    saver, _ = saver_at(tmp_path, trainer)
    saver.start(0, {"rollout": {}}, {"rollout_id": 0})
    saver.start(1, {"rollout": {}}, {"rollout_id": 1})  # waits for 0, commits it, begins 1
    assert latest_checkpoint(tmp_path)[0] == 0 and not (tmp_path / checkpoint_name(1)).exists()
    saver.wait()
    assert latest_checkpoint(tmp_path)[0] == 1 and saver.pending is None


def test_a_failed_write_is_raised_and_never_committed(tmp_path):
    class FailingWriter(HeldWriter):
        def finish_save(self) -> None:
            super().finish_save()
            raise OSError(28, "No space left on device")

    saver, _ = saver_at(tmp_path, FailingWriter())
    saver.start(0, {"rollout": {}}, {"rollout_id": 0})
    with pytest.raises(OSError, match="No space"):
        saver.wait()
    assert latest_checkpoint(tmp_path) is None and not (tmp_path / checkpoint_name(0)).exists()


def test_a_failure_after_a_save_began_still_commits_it_once_written(tmp_path):
    trainer = HeldWriter()
    saver, _ = saver_at(tmp_path, trainer)
    with pytest.raises(RuntimeError, match="non-finite"):
        with saver.committed_on_failure():
            saver.start(0, {"rollout": {}}, {"rollout_id": 0})
            raise RuntimeError("non-finite train/loss at rollout 1")  # before any boundary polls
    assert latest_checkpoint(tmp_path)[0] == 0


def test_a_failure_whose_pending_write_fails_too_reports_the_first_and_commits_nothing(tmp_path):
    class DeadRank(HeldWriter):
        def finish_save(self) -> None:
            super().finish_save()
            raise ConnectionError("the rank died")

    saver, lines = saver_at(tmp_path, DeadRank())
    with pytest.raises(RuntimeError, match="killed"):
        with saver.committed_on_failure():
            saver.start(0, {"rollout": {}}, {"rollout_id": 0})
            raise RuntimeError("train rank 0 killed")
    assert latest_checkpoint(tmp_path) is None and "not committed: ConnectionError" in lines[-1]
