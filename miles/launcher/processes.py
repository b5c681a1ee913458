"""Processes the launcher starts, and ending exactly those later.

Everything the launcher starts carries `MILES_LAUNCH_TOKEN=<token>` in its environment and the
token is recorded under `<output_dir>/.launcher/<role>.json`. Cleanup scans /proc for that token:
it finds Ray's daemons and workers even when they moved to a session of their own, and it can
never match a process someone else started (we never match by name).

`ray start` also runs in a session of its own, recorded beside the token, and every Ray daemon it
starts stays in that session. Cleanup ends the session's members too: a raylet's dashboard and
runtime-env agents were seen alive after every token scan came back empty (their environment no
longer readable as ours), and they are still members of the session. A session id stays taken
while any member lives, so its members are ours; once our leader (`ray start`) has exited, a live
process with that pid would mean the id was reused, and then the session is left alone.
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from miles.launcher.launch_mode import is_dry_run

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
    session: int | None = None  # the session `ray start` ran in (its pid); its daemons stay in it
    launcher_pid: int = field(default_factory=os.getpid)
    # a head's own Ray auth token file (ray_auth): made fresh when its node starts, removed when it ends
    auth_token_file: str | None = None

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
        # a record another version of the launcher wrote: the fields this one knows (cleanup needs the token)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


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


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return needle in fh.read().split(b"\0")
    except OSError:  # gone, or not ours to read: either way not ours to end
        return False


def _needle(token: str, env_name: str) -> bytes:
    return f"{env_name}={token}".encode()


def pids_with_token(token: str, env_name: str = TOKEN_ENV) -> list[int]:
    """Live processes whose initial environment holds `<env_name>=<token>` (not us or our ancestors)."""
    needle = _needle(token, env_name)
    spared = _self_and_ancestors()
    return sorted(int(e.name) for e in os.scandir("/proc")
                  if e.name.isdigit() and int(e.name) not in spared and is_alive(int(e.name))
                  and _environ_has(int(e.name), needle))


def _self_and_ancestors() -> set[int]:
    pids, pid = {0, 1}, os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        pid = _parent_pid(pid)
    return pids


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name, which may hold spaces: [state, ppid, pgrp,
    session, ...] (stat's fields 3 onwards); [] for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _parent_pid(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if fields else 0


def is_alive(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def describe(pid: int) -> str:
    """"pid cmdline (parent P, up Ts)": the parent and age say whether a leftover was respawned."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid} {cmd[:200]}{_lineage(pid)}"


def _lineage(pid: int) -> str:
    fields = _stat(pid)
    try:
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # stat's field 22: start time in ticks
        return f" (parent {fields[1]}, up {age:.1f}s)"
    except (OSError, IndexError, ValueError):
        return ""


def _session_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[3]) if fields else None


def _leaderless(sessions: Iterable[int | None]) -> set[int]:
    """The sessions whose leader has exited: a session id that is a live process's pid was reused,
    and is not the session our exited `ray start` left."""
    return {s for s in sessions if s and not is_alive(s)}


def pids_in_session(*sessions: int | None) -> list[int]:
    """Live members of our leaderless sessions (not us or our ancestors)."""
    ours = _leaderless(sessions)
    if not ours:
        return []
    spared = _self_and_ancestors()
    return sorted(int(e.name) for e in os.scandir("/proc")
                  if e.name.isdigit() and int(e.name) not in spared and _session_of(int(e.name)) in ours
                  and is_alive(int(e.name)))


def signal_if_in_session(pid: int, sig: int, sessions: Iterable[int | None]) -> bool:
    """Signal `pid` only if, right now, it is a member of one of our leaderless sessions."""
    if pid in _self_and_ancestors() or _session_of(pid) not in _leaderless(sessions):
        return False
    return _kill(pid, sig)


def signal_if_marked(pid: int, sig: int, token: str, env_name: str = TOKEN_ENV) -> bool:
    """Signal `pid` only if, right now, its environment carries the token: a pid (or a process
    group id) seen earlier may belong to someone else by now. Never a process group."""
    if pid in _self_and_ancestors() or not _environ_has(pid, _needle(token, env_name)):
        return False
    return _kill(pid, sig)


def _kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


QUIET_S = 2.0  # the launcher's: how long no process may carry the token before a cleanup counts as done
# SIGTERM to SIGKILL. An idle Ray head's gcs_server, raylet, autoscaler monitor and runtime-env
# agent, signalled together, are all still alive 10 s after SIGTERM (each waits on another for a
# graceful drain), so a longer grace only delays the SIGKILL every cleanup ends with. What a run
# must keep survives a SIGKILL: checkpoints are committed atomically, logs are written as they go.
TERM_GRACE_S = 3.0


def end_marked_processes(
    token: str,
    env_name: str = TOKEN_ENV,
    *,
    grace_s: float = TERM_GRACE_S,
    kill_wait_s: float = 5.0,
    on_poll: Callable[[], None] | None = None,
    descriptions: dict[int, str] | None = None,
    quiet_s: float = QUIET_S,
    sessions: Iterable[int | None] = (),
) -> tuple[list[int], list[int]]:
    """End every process carrying `<env_name>=<token>`: SIGTERM, up to `grace_s`, then SIGKILL.
    Processes that appear meanwhile (a daemon forking) are found by re-scanning. Each signal goes
    to a pid re-verified as carrying the token at that moment. Returns (ended, survivors).

    The one cleanup of launcher and test harness alike; `on_poll` lets a caller reap children;
    `descriptions` receives "pid cmdline" of each process when it is first found; `quiet_s` is how
    long no process may carry the token before the cleanup counts as done; `sessions`, the recorded
    sessions of `ray start` (one a node), whose members are ended as well (see the module docstring)."""
    poll = on_poll or (lambda: None)
    sessions = tuple(sessions)
    seen: list[int] = []
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        deadline = time.monotonic() + wait
        signalled: set[int] = set()
        while True:
            poll()
            targets = _ours(token, env_name, sessions)
            for pid in targets:
                if pid not in seen:
                    seen.append(pid)
                    if descriptions is not None:
                        descriptions[pid] = describe(pid)
                if pid not in signalled and (signal_if_marked(pid, sig, token, env_name)
                                             or signal_if_in_session(pid, sig, sessions)):
                    signalled.add(pid)
            if not targets:
                # A raylet that was still alive a moment ago may have respawned its dashboard or
                # runtime-env agent after this scan; on a loaded machine that child shows up well
                # after its parent is gone (seen: after a single 0.3 s look). Done only once
                # nothing of ours has shown up for quiet_s. When nothing of ours was alive at the
                # first scan there is no parent to respawn anything (a launch that started nothing,
                # the harness behind a launcher that cleaned up): done at once.
                if seen and not _stays_quiet(token, env_name, poll, quiet_s, sessions):
                    continue
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not targets:
            break
    poll()
    return seen, _ours(token, env_name, sessions)


def _ours(token: str, env_name: str, sessions: tuple[int | None, ...]) -> list[int]:
    return sorted(set(pids_with_token(token, env_name)) | set(pids_in_session(*sessions)))


def _stays_quiet(token: str, env_name: str, poll: Callable[[], None], quiet_s: float = QUIET_S,
                 sessions: tuple[int | None, ...] = ()) -> bool:
    """True if nothing of ours shows up for `quiet_s`; False as soon as something does."""
    until = time.monotonic() + quiet_s
    while time.monotonic() < until:
        time.sleep(0.2)
        poll()
        if _ours(token, env_name, sessions):
            return False
    return True


def end_token_processes(token: str, grace_s: float = TERM_GRACE_S, session: int | None = None) -> list[int]:
    """End every process carrying the launcher's token (and the members of its Ray session)."""
    return end_marked_processes(token, TOKEN_ENV, grace_s=grace_s, sessions=(session,))[0]


def pgids_of(pids: Iterable[int]) -> list[int]:
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    return sorted(groups)


LONG_EXEC = 300  # characters: a longer command shown whole would fill a screen


def print_exec(cmd: str, full_to: Path | None = None) -> None:
    """`EXEC: <cmd>`; with `full_to`, a long command is written there whole and shown cut,
    naming that file."""
    if full_to is None or len(cmd) <= LONG_EXEC:
        print(f"EXEC: {cmd}", flush=True)
        return
    Path(full_to).write_text(cmd + "\n")
    print(f"EXEC: {cmd[:160]} ... ({len(cmd)} characters; the whole command: {full_to})", flush=True)


# What this process ran through exec_command before the launch was planned: a recipe's prepare()
# downloads, in order. The plan records them (dry or real), and so does the dry-run snapshot.
RECIPE_COMMANDS: list[str] = []


def exec_command(
    cmd: str | list[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
    capture_output: bool = False,
    dry_run: bool | None = None,
    log_path: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """Print `EXEC: <cmd>` and run it with bash; in a dry run only print it. With `log_path` the
    command's output is appended there instead of shown. Every command is also kept in
    RECIPE_COMMANDS, so the launch plan records what prepare() ran (or would run)."""
    text = cmd if isinstance(cmd, str) else shlex.join(cmd)
    print_exec(text)
    RECIPE_COMMANDS.append(text)
    if dry_run is None:
        dry_run = is_dry_run()
    if dry_run:
        return subprocess.CompletedProcess(text, 0, "" if capture_output else None, "" if capture_output else None)
    sys.stdout.flush()
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            log.write(f"$ {text}\n")
            log.flush()
            return subprocess.run(["bash", "-c", text], env=None if env is None else dict(env), cwd=cwd,
                                  check=check, stdout=log, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(
        ["bash", "-c", text], env=None if env is None else dict(env), cwd=cwd, check=check,
        capture_output=capture_output, text=True,
    )
