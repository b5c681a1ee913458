import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.launcher.local_cluster import HEAD_ROLE, end_recorded_run
from miles.launcher.processes import (
    LaunchRecord,
    environ_with_token,
    exec_command,
    is_alive,
    new_token,
    pids_with_token,
    write_text_atomically,
)

_SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _sleeper(env=None, new_session=False):
    return subprocess.Popen(_SLEEP, env=env, start_new_session=new_session)


def _wait_gone(pids, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _reap(*procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_cleanup_ends_only_the_processes_an_earlier_run_recorded(tmp_path):
    token = new_token()
    recorded = _sleeper(env=environ_with_token(token), new_session=True)  # setsid: not findable by group
    unrelated = _sleeper()
    try:
        LaunchRecord(HEAD_ROLE, token).save(tmp_path)
        ended = end_recorded_run(tmp_path, HEAD_ROLE)
        assert recorded.wait(timeout=15) is not None
        assert ended == [recorded.pid]
        assert unrelated.poll() is None and is_alive(unrelated.pid)
        assert not LaunchRecord.path_for(tmp_path, HEAD_ROLE).exists()
    finally:
        _reap(recorded, unrelated)


def test_cleanup_without_a_record_ends_nothing(tmp_path):
    bystander = _sleeper()
    try:
        assert end_recorded_run(tmp_path, HEAD_ROLE) == []
        assert bystander.poll() is None
    finally:
        _reap(bystander)


def test_cleanup_never_deletes_a_temp_dir_of_a_shape_it_did_not_create(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    LaunchRecord(HEAD_ROLE, new_token(), ray_temp_dir=str(precious)).save(tmp_path)
    end_recorded_run(tmp_path, HEAD_ROLE)
    assert precious.is_dir()


def test_token_scan_finds_grandchildren_and_never_ourselves():
    token = new_token()
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(120)']); time.sleep(120)"],
        env=environ_with_token(token),
    )
    try:
        for _ in range(100):
            found = pids_with_token(token)
            if len(found) == 2:
                break
            subprocess.run(["sleep", "0.1"])
        assert parent.pid in found and len(found) == 2 and os.getpid() not in found
    finally:
        for pid in pids_with_token(token):
            os.kill(pid, 9)
        parent.wait(timeout=10)


def test_record_round_trips_through_its_file(tmp_path):
    record = LaunchRecord("worker", "abc", ray_temp_dir="/tmp/mray-abc", pgids=[12])
    record.save(tmp_path)
    assert LaunchRecord.load(tmp_path, "worker") == record


def test_a_record_with_fields_this_launcher_does_not_know_still_loads_for_cleanup(tmp_path):
    path = LaunchRecord.path_for(tmp_path, "head")
    path.parent.mkdir(parents=True)
    path.write_text('{"role": "head", "token": "abc", "field_of_a_newer_launcher": 1}')
    loaded = LaunchRecord.load(tmp_path, "head")
    assert (loaded.role, loaded.token, loaded.auth_token_file) == ("head", "abc", None)


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "sub" / "x.json"
    write_text_atomically(target, "one")
    write_text_atomically(target, "two")
    assert target.read_text() == "two" and [p.name for p in target.parent.iterdir()] == ["x.json"]


def test_exec_command_prints_exec_line_and_dry_run_does_not_run(tmp_path, capsys):
    marker = tmp_path / "ran"
    exec_command(f"touch {marker}", dry_run=True)
    assert not marker.exists()
    exec_command(f"touch {marker}", dry_run=False)
    assert marker.exists()
    assert capsys.readouterr().out.count(f"EXEC: touch {marker}") == 2


def test_a_process_that_takes_up_the_token_just_after_the_last_one_ended_is_ended_too():
    # what a raylet does on a loaded machine: its agent respawns after the first scan found nothing
    import threading

    from miles.launcher.processes import QUIET_S, end_marked_processes

    token = new_token()
    env = environ_with_token(token)
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    late: list[subprocess.Popen] = []
    spawn_after = QUIET_S / 2
    timer = threading.Timer(spawn_after, lambda: late.append(subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env)))
    timer.start()
    try:
        ended, survivors = end_marked_processes(token, on_poll=lambda: [p.poll() for p in [first, *late]])
        timer.join()
        assert first.pid in ended and late and late[0].pid in ended, (ended, late)
        assert survivors == [] and late[0].wait(timeout=5) is not None
    finally:
        timer.cancel()
        for proc in [first, *late]:
            proc.kill()
            proc.wait()


def test_a_cleanup_that_finds_nothing_of_its_own_returns_without_waiting_the_quiet_window(monkeypatch):
    # nothing carried the token at the first scan, so nothing can respawn: no quiet window to wait out
    # (the harness's cleanup behind a launcher that cleaned up, a launch that started nothing)
    from miles.launcher import processes

    waited = []
    monkeypatch.setattr(processes, "_stays_quiet", lambda *a, **k: waited.append(a) or True)
    assert processes.end_marked_processes(new_token()) == ([], [])
    assert waited == []

    token = new_token()  # one process of its own: the window is waited out once it has ended
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=environ_with_token(token))
    try:
        ended, survivors = processes.end_marked_processes(token, on_poll=proc.poll)
        assert ended == [proc.pid] and survivors == [] and len(waited) == 1
    finally:
        proc.kill()
        proc.wait()


def _leaderless_session_child(env):
    """What `ray start` leaves: a session whose leader has exited and a daemon still in it, here
    one whose environment does not show the token (as a raylet's agents were seen)."""
    starter = subprocess.Popen(
        ["bash", "-c", f"env -u MILES_LAUNCH_TOKEN {sys.executable} -c 'import time; time.sleep(120)' "
                       "</dev/null >/dev/null 2>&1 & echo $!"],
        env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(starter.stdout.readline())
    starter.wait(timeout=10)
    # `$!` is known at the fork, before the child has exec'd `env -u` and `env` has exec'd python:
    # until then it still carries the token (seen under a loaded suite). `env`'s own command line
    # holds the sleeper's words too, so wait until python is the program (its first argument)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != sys.executable.encode():
        assert time.monotonic() < deadline, "the daemon never started"
        time.sleep(0.01)
    return starter.pid, child


def test_stop_ends_the_daemons_left_in_the_ray_start_session_even_without_a_visible_token(tmp_path):
    from miles.launcher.local_cluster import stop_node
    from miles.launcher.processes import pids_in_session

    token = new_token()
    session, daemon = _leaderless_session_child(environ_with_token(token))
    bystander = _sleeper(env={k: v for k, v in os.environ.items() if k != "MILES_LAUNCH_TOKEN"}, new_session=True)
    try:
        assert daemon not in pids_with_token(token) and pids_in_session(session) == [daemon]
        stop_node(LaunchRecord("head", token, session=session))
        _wait_gone([daemon])
        assert not is_alive(daemon)
        assert bystander.poll() is None  # another session is never touched
    finally:
        _reap(bystander)
        if is_alive(daemon):
            os.kill(daemon, 9)


def test_a_session_id_taken_by_a_live_process_is_not_ours():
    from miles.launcher.processes import pids_in_session

    leader = _sleeper(new_session=True)  # a session whose leader lives: the id may have been reused
    try:
        assert pids_in_session(leader.pid) == []
    finally:
        _reap(leader)


def test_a_ray_start_that_never_returns_ends_in_one_line_naming_its_log_and_its_daemons_end(tmp_path, monkeypatch):
    # Ray 2.60's `ray start` waits without end for a node whose raylet died starting
    from miles.launcher import local_cluster
    from miles.launcher.ray_auth import own_cluster_auth
    from miles.launcher.ray_cluster import RayNodeSpec, RayPorts, ray_temp_dir_for

    token = new_token()
    monkeypatch.setattr(local_cluster, "RAY_START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(local_cluster, "ray_start_command", lambda spec, devices: f"{sys.executable} -c "
                        "'import time; time.sleep(120)' & wait")
    record = LaunchRecord(HEAD_ROLE, token)
    spec = RayNodeSpec("127.0.0.1", RayPorts.allocate(), ray_temp_dir_for(token), 0, 1)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as caught:
            local_cluster.start_node(spec, record, tmp_path, None, auth=own_cluster_auth(tmp_path, environ={}))
    finally:
        daemons = pids_with_token(token)
        local_cluster.stop_node(record)
    message = str(caught.value)
    assert time.monotonic() - started < 30
    assert "`ray start` did not finish within 1 s" in message and str(tmp_path) in message and "\n" not in message
    assert daemons  # the daemon outlived its bash, in the recorded session
    _wait_gone(daemons)
    assert not any(is_alive(p) for p in daemons)
