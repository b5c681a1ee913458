"""Processes the launcher starts, and ending exactly those later.

Everything the launcher starts carries `MILES_LAUNCH_TOKEN=<token>` in its environment and the
token is recorded under `<output_dir>/.launcher/<role>.json`. Cleanup scans /proc for that token:
it finds Ray's daemons and workers even when they moved to a session of their own, and it can
never match a process someone else started (we never match by name).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from miles.utils.external_utils.launch_mode import is_dry_run

TOKEN_ENV = "MILES_LAUNCH_TOKEN"
RECORD_DIR_NAME = ".launcher"


def new_token() -> str:
    return secrets.token_hex(8)


@dataclass
class LaunchRecord:
    """What one launcher role started; enough for a later run to end it.

    Cleanup goes by the token. The process groups are recorded for people reading the record,
    not for killpg: Ray's daemons share the launcher's group, and a recorded group id can be
    reused by an unrelated process once that launcher is gone.
    """

    role: str
    token: str
    ray_temp_dir: str | None = None
    pgids: list[int] = field(default_factory=list)
    launcher_pid: int = field(default_factory=os.getpid)

    @staticmethod
    def path_for(output_dir: str | Path, role: str) -> Path:
        return Path(output_dir) / RECORD_DIR_NAME / f"{role}.json"

    def save(self, output_dir: str | Path) -> Path:
        path = self.path_for(output_dir, self.role)
        write_text_atomically(path, json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, output_dir: str | Path, role: str) -> LaunchRecord | None:
        path = cls.path_for(output_dir, role)
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return cls(**data)


def write_text_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def environ_with_token(token: str, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(extra)
    env[TOKEN_ENV] = token
    return env


def pids_with_token(token: str) -> list[int]:
    """Live processes whose initial environment holds MILES_LAUNCH_TOKEN=token (not us or our ancestors)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    spared = _self_and_ancestors()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # gone, or not ours to read: either way not ours to end
            continue
    return found


def _self_and_ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        pid = _parent_pid(pid)
    return pids


def _parent_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # the command name (field 2) may contain spaces; fields after the last ')' are fixed
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def end_processes(pids: Iterable[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM, wait up to grace_s, then SIGKILL what is left. Returns the pids signalled."""
    pids = [p for p in pids if is_alive(p)]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(is_alive(p) for p in pids):
        time.sleep(0.1)
    _signal_all([p for p in pids if is_alive(p)], signal.SIGKILL)
    return pids


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_token_processes(token: str, grace_s: float = 10.0) -> list[int]:
    """End every process carrying the token; repeat once for children spawned meanwhile."""
    ended = end_processes(pids_with_token(token), grace_s)
    late = pids_with_token(token)
    if late:
        ended += end_processes(late, grace_s=2.0)
    return ended


def pgids_of(pids: Iterable[int]) -> list[int]:
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    return sorted(groups)


def print_exec(cmd: str) -> None:
    print(f"EXEC: {cmd}", flush=True)


def exec_command(
    cmd: str | list[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
    capture_output: bool = False,
    dry_run: bool | None = None,
) -> subprocess.CompletedProcess:
    """Print `EXEC: <cmd>` and run it with bash; in a dry run only print it."""
    text = cmd if isinstance(cmd, str) else shlex.join(cmd)
    print_exec(text)
    if dry_run is None:
        dry_run = is_dry_run()
    if dry_run:
        return subprocess.CompletedProcess(text, 0, "" if capture_output else None, "" if capture_output else None)
    sys.stdout.flush()
    return subprocess.run(
        ["bash", "-c", text], env=None if env is None else dict(env), cwd=cwd, check=check,
        capture_output=capture_output, text=True,
    )
