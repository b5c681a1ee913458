"""Issue 27 point 6: the open-files warning only when the limit is below what the node needs, once."""

from __future__ import annotations

import subprocess
import sys

WARN = (
    "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}));"
    "from miles.launcher.local_cluster import warn_open_files_once, open_files_needed;"
    "from miles.launcher.ray_cluster import RayNodeSpec, RayPorts;"
    "need = open_files_needed(RayNodeSpec('127.0.0.1', RayPorts(), '/tmp/mray-x', 0, {cpus}));"
    "print('need', need); print('soft', warn_open_files_once(need)); warn_open_files_once(need)"
)


def _run(soft: int, hard: int, cpus: int) -> subprocess.CompletedProcess:
    code = WARN.format(soft=soft, hard=hard, cpus=cpus)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_a_limit_below_what_the_node_needs_is_raised_and_warned_about_once_with_the_fix():
    result = _run(256, 1024, cpus=2)  # the hard limit, 1024, is below 2048 + 256 x 2 = 2560
    assert "need 2560" in result.stdout and "soft 1024" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "open-files limit" in line]
    assert len(warnings) == 1 and "1024 is below the ~2560" in warnings[0] and "fix: raise the hard limit" in warnings[0]


def test_a_limit_that_covers_the_node_is_raised_silently():
    result = _run(256, 4096, cpus=2)
    assert "soft 4096" in result.stdout and result.stderr == ""
