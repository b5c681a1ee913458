"""Issue 11, point 7: cleanup signals only processes it has just verified as carrying its token."""

import os
import subprocess
import sys

from miles.testing.runner import TOKEN_ENV, end_processes, new_token
from miles.launcher import processes


def _sleeper(env=None):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)


def test_a_process_group_id_is_never_signalled_after_the_recipe_exited():
    # The recipe's group id now belongs to an unrelated process (here: one in a session of its own
    # whose pgid we pass): it carries no token, so it must survive.
    stranger = _sleeper()
    try:
        ended, survivors = end_processes(new_token(), stranger.pid, grace=1)
        assert ended == [] and survivors == []
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_marked_process_is_ended_and_an_unmarked_one_in_the_same_scan_is_not():
    token = new_token()
    marked = _sleeper({**os.environ, TOKEN_ENV: token})
    stranger = _sleeper()
    try:
        ended, survivors = end_processes(token, grace=2, reap=[marked])
        assert any(str(marked.pid) in e and "time.sleep(60)" in e for e in ended) and survivors == []
        assert marked.wait(timeout=10) is not None and stranger.poll() is None
    finally:
        for p in (marked, stranger):
            p.kill()
            p.wait()


def test_signal_if_marked_refuses_an_unmarked_pid():
    stranger = _sleeper()
    try:
        assert not processes.signal_if_marked(stranger.pid, 15, "no-such-token", TOKEN_ENV)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_harness_and_launcher_share_one_implementation():
    import miles.testing.cluster as cluster
    import miles.testing.runner as runner
    from miles.rollout.rm_hub import registry
    from miles.utils import dotted_path

    assert runner.describe is processes.describe
    assert "_ray_cluster.ray_start_command" in open(cluster.__file__).read()
    assert "def free_ports" in open(cluster.__file__).read() and "_ray_cluster.free_ports" in open(cluster.__file__).read()
    assert registry.load_callable is dotted_path.load_callable
