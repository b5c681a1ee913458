"""A cluster over several hosts never binds its head to loopback: refused before anything starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.launcher.multinode import (
    SINGLE_HOST_ENV,
    LoopbackHeadError,
    check_head_address,
    check_worker_head,
    is_loopback,
)

RECIPE = Path(__file__).with_name("example_recipe.py")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"])
def test_loopback_spellings_are_recognised(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["10.0.0.7", "192.168.1.2", "node-0.cluster", "fe80::1"])
def test_routable_addresses_and_names_are_not_loopback(host):
    assert not is_loopback(host)


def test_multi_node_head_on_loopback_is_refused_naming_master_addr():
    with pytest.raises(LoopbackHeadError, match=r"--num-nodes 3 with MASTER_ADDR=127\.0\.0\.1.*fix: export MASTER_ADDR="):
        check_head_address(3, "127.0.0.1", environ={})


def test_one_node_a_routable_head_or_a_declared_single_host_cluster_passes():
    check_head_address(1, "127.0.0.1", environ={})
    check_head_address(3, "10.0.0.7", environ={})
    check_head_address(3, "127.0.0.1", environ={SINGLE_HOST_ENV: "1"})


def test_worker_refuses_a_loopback_head_unless_single_host():
    with pytest.raises(LoopbackHeadError, match=r"--head-address localhost:6379 is loopback"):
        check_worker_head("localhost:6379", environ={})
    check_worker_head("10.0.0.7:6379", environ={})
    check_worker_head("127.0.0.1:6379", environ={SINGLE_HOST_ENV: "1"})


def _run(tmp_path, role_argv, **env):
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("MILES_SCRIPT_") and k not in ("MASTER_ADDR", SINGLE_HOST_ENV)}
    environ.update(env)
    return subprocess.run([sys.executable, str(RECIPE), *role_argv], capture_output=True, text=True, env=environ,
                          cwd=tmp_path, timeout=60, start_new_session=True)


def test_real_multi_node_launch_on_loopback_exits_2_before_any_node_starts(tmp_path):
    out = tmp_path / "out"
    result = _run(tmp_path, ["train", "--output-dir", str(out), "--run-id", "r1", "--num-nodes", "2"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MASTER_ADDR=127.0.0.1" in result.stderr and "ray start" not in result.stdout
    assert not (out / ".launcher").exists()  # no head was recorded: nothing started


def test_dry_multi_node_launch_on_loopback_plans_and_says_it_would_be_refused(tmp_path):
    result = _run(tmp_path, ["train", "--output-dir", str(tmp_path / "out"), "--run-id", "r1", "--num-nodes", "2"],
                  MILES_SCRIPT_ENABLE_RAY_SUBMIT="0")
    assert result.returncode == 0, result.stderr
    assert "note: a real launch would be refused" in result.stderr and "MASTER_ADDR" in result.stderr


def test_real_worker_with_a_loopback_head_exits_2_and_records_nothing(tmp_path):
    out = tmp_path / "worker"
    result = _run(tmp_path, ["worker", "--head-address", "127.0.0.1:6399", "--output-dir", str(out)])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is loopback" in result.stderr and not out.exists()
