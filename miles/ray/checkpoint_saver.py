"""The driver's side of a background checkpoint save.

`start` waits for the previous save to be committed, has every train rank copy the checkpoint's
state to the host and start writing it (miles.backends.checkpoint_writer), writes the driver's
own files into the same staging directory and returns: training goes on while the ranks write.
The save is committed (every file fsynced, the directory renamed into place, `latest` moved:
miles.backends.checkpoint.commit, exactly as a synchronous save did) only once every rank's write
has ended: at the first rollout boundary where `poll` finds it ended, or when the next save or
the run's end waits for it (`wait`). A kill before that leaves the previous checkpoint whole and
named; the staging directory is removed by the next save of that rollout id.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from miles.backends import checkpoint as ckpt
from miles.records import checkpoint_identity as identity


@dataclass
class _Pending:
    rollout_id: int
    staging: Path
    began: float
    stall_s: float


class CheckpointSaver:
    def __init__(self, args: Any, trainer: Any, log: Callable[[str], None]):
        self.args, self.trainer, self.log = args, trainer, log
        self.pending: _Pending | None = None

    def start(self, rollout_id: int, driver_state: dict, record: dict) -> float:
        """Begin the save of `rollout_id`; returns the seconds training waited for it (the
        previous save's end, the ranks' host copies, the driver's files)."""
        began = time.perf_counter()
        self.wait()
        staging = ckpt.staging_dir(self.args.save, rollout_id)
        self.trainer.begin_save(str(staging))
        torch.save(driver_state, staging / "driver.pt")
        (staging / identity.RECORD).write_text(json.dumps(record, indent=1) + "\n")
        stall = time.perf_counter() - began
        self.pending = _Pending(rollout_id, staging, began, stall)
        return stall

    def poll(self) -> None:
        """Commit the pending save if every rank has written it; never waits for a write."""
        if self.pending is not None and self.trainer.save_done():
            self._commit()

    def wait(self) -> None:
        """Until the pending save (if any) is written and committed."""
        if self.pending is not None:
            self.trainer.finish_save()
            self._commit()

    @contextlib.contextmanager
    def committed_on_failure(self):
        """If the loop fails, the pending save (a state from before the failure, checked finite) is
        still committed when every rank's write ends; a dead or failing rank leaves it uncommitted."""
        try:
            yield
        except Exception:  # not a signal or an exit: those end the run without waiting for a write
            try:
                self.wait()
            except Exception as err:  # the loop's own error is the one to report
                self.log(f"the save of rollout {self.pending.rollout_id if self.pending else '?'} was not "
                         f"committed: {type(err).__name__}")
            raise

    def _commit(self) -> None:
        pending, self.pending = self.pending, None
        self.trainer.finish_save()  # raises a rank's write error; returns at once after save_done
        committed = ckpt.commit(pending.staging, self.args.save, pending.rollout_id, keep_last=self.args.keep_last,
                                keep_every=self.args.keep_every)
        self.log(f"saved checkpoint {committed} (training waited {pending.stall_s:.2f} s; written and committed "
                 f"{time.perf_counter() - pending.began:.2f} s after the save began)")
