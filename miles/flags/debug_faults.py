"""--debug-fault: which actor fails how, at which rollout, and the failure itself.

Ray-free and torch-free, so the flag parser (`miles.flags.arguments`) and the actors that carry a
fault out (engines, reward workers, train ranks) can all use it; arming an actor from the driver
lives in `miles.ray.faults`. The fault suite (tests/e2e/test_faults.py) drives it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

# --debug-fault kinds: which actor, and what happens to it
FAULT_KINDS = {
    "train-kill": "a train rank SIGKILLs itself mid-step",
    "engine-kill": "a rollout engine SIGKILLs itself mid-sampling",
    "reward-kill": "a reward worker SIGKILLs itself while scoring",
    "reward-hang": "a reward worker never answers (the deadline ends the run)",
    "nan": "the loss becomes NaN (the bad update is never saved)",
    "disk-full": "RLIMIT_FSIZE in the train rank during the save (writes fail with EFBIG)",
    "slow-save": "the train rank's background save takes 60 s longer to end (time to signal the launcher "
                 "or kill the rank mid-save while training goes on)",
    "engine-init": "the last rollout engine's constructor raises: it is given a checkpoint directory that does not "
                   "exist (start-up: use @0)",
    "train-setup": "the last train rank's set-up raises: it is given a checkpoint directory that does not exist "
                   "(start-up: use @0)",
}
SLOW_SAVE_S = 60.0  # longer than a tiny rollout on a loaded machine: the kill lands while it writes
# faults of the start-up, before rollout 0: carried out where the actor is created or set up
START_KINDS = ("engine-init", "train-setup")


def parse_fault(spec: str) -> tuple[str, int]:
    """'engine-kill@1' -> ('engine-kill', 1); raises ValueError naming the kinds."""
    kind, sep, rollout = (spec or "").partition("@")
    if kind not in FAULT_KINDS or not sep or not rollout.isdigit():
        raise ValueError(f"--debug-fault {spec!r}: expected KIND@ROLLOUT with KIND one of {', '.join(FAULT_KINDS)}")
    if kind in START_KINDS and int(rollout) != 0:
        raise ValueError(f"--debug-fault {spec!r}: {kind} strikes at start-up, before rollout 0; use {kind}@0")
    return kind, int(rollout)


def fault_due(args: Any, kind: str, rollout_id: int) -> bool:
    """True once per run dir when `--debug-fault kind@rollout_id` is set; leaves the marker."""
    spec = getattr(args, "debug_fault", None)
    if not spec:
        return False
    want, at = parse_fault(spec)
    if want != kind or at != rollout_id:
        return False
    marker = Path(args.run_dir) / "faults" / f"{kind}@{rollout_id}"
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{time.time()}\n")
    return True


def missing_checkpoint(args: Any, kind: str) -> str | None:
    """For a start-up kind (`engine-init`, `train-setup`) due in this run dir: the checkpoint
    directory the failing actor gets instead of its own, one that does not exist, so the real
    loader raises as it does for a user's wrong path. None otherwise (and after it fired once)."""
    if not fault_due(args, kind, 0):
        return None
    return str(Path(args.run_dir) / "faults" / "no-such-checkpoint")


def _arm(self: Any, kind: str) -> None:
    self._miles_fault = kind


def take(actor_self: Any, kind: str) -> bool:
    """Disarm `kind` if it is the armed fault; True if it was (the caller carries it out itself)."""
    if getattr(actor_self, "_miles_fault", None) != kind:
        return False
    actor_self._miles_fault = None
    return True


def fire(actor_self: Any, kind: str | None = None) -> None:
    """Called at the start of an injectable method: carry out the armed fault, if any."""
    armed = getattr(actor_self, "_miles_fault", None)
    if armed is None or (kind is not None and armed != kind):
        return
    actor_self._miles_fault = None
    if armed == "reward-kill":  # scoring takes milliseconds: die inside the call, as an OOM kill would
        os.kill(os.getpid(), signal.SIGKILL)
    elif armed.endswith("-kill"):
        # mid-call: let the method start its work (seconds of sampling or training), then die
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    elif armed == "reward-hang":
        while True:
            time.sleep(3600)
    elif armed == "disk-full":
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    elif armed == "slow-save":
        time.sleep(SLOW_SAVE_S)
