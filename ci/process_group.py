"""Ending a case's process group, for the local runner and for a case run as a Ray task.

A case starts in a session of its own (`start_new_session=True`), so its group holds the harness
and whatever it started (Ray, the trainer), and nothing of anyone else's. The standard library
only: ci/ray_case.py imports this inside Ray workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

KILL_GRACE = 15.0  # seconds a case has after SIGTERM before SIGKILL


def end_group(proc: subprocess.Popen) -> None:
    """Ends the case's whole process group: the harness may have started Ray and more. Returns
    once the group is empty (not just its leader: on a loaded machine a signalled child can take
    a while to die), escalating to SIGKILL after the grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so only live members keep the group
            if not _group_alive(proc.pid):
                return
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    # while any member lives the kernel keeps the group id, so it cannot name a stranger's group
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
