"""A throw-away multi-node Ray cluster on loopback, for recipes that expect an external cluster.

Every node is a plain `ray start` with ports and a temp dir of its own, so concurrent tests
(pytest-xdist workers, other pytest processes) never share a cluster. All daemons inherit the
test's token (`MILES_TEST_TOKEN`) or stay in the session their `ray start` ran in, which is how
`stop()` finds and ends them: never by name, never with Ray's own stop command (that would end
every Ray on the machine).

Like every cluster the launcher starts, it requires a Ray token of its own (a fresh one in a 0600
file in its temp dir, named to every node: miles.launcher.ray_auth); whatever token
the test process or ~/.ray holds never reaches it. `auth_env()` is what a client process needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from miles.testing.dry import scrubbed_env
from miles.testing.runner import TOKEN_ENV, end_processes, new_token
from miles.launcher import ray_auth as _ray_auth
from miles.launcher import ray_cluster as _ray_cluster

def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (the launcher's own port search)."""
    return _ray_cluster.free_ports(n, "127.0.0.1")


@dataclass
class LocalRayCluster:
    """`nodes` Ray nodes on 127.0.0.1: a head (with the job server) and `nodes - 1` workers."""

    nodes: int = 2
    cpus_per_node: int = 2
    gpus_per_node: int = 0
    token: str = field(default_factory=new_token)
    object_store_bytes: int = 100 * 2**20
    # generous: on a loaded 2-core machine a head's start-up alone has taken over two minutes
    start_timeout: float = 300.0
    temp_dir: Path | None = None
    gcs_port: int = 0
    dashboard_port: int = 0
    log_path: Path | None = None
    last_error: str = ""
    # the session each `ray start` ran in (its pid): a raylet starts its dashboard agent without
    # our token, and stop() finds it there (left behind, its raylet gone, it spun for minutes)
    sessions: list[int] = field(default_factory=list)
    _owned_temp: bool = False

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def address(self) -> str:
        """The job server's address (what `RAY_ADDRESS` holds for `ray job submit`)."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def auth(self) -> "_ray_auth.ClusterAuth":
        """The cluster's token, in its own file (written when the head starts)."""
        assert self.temp_dir is not None, "the cluster has not been started"
        return _ray_auth.own_cluster_auth(self.temp_dir, environ={})

    def auth_env(self) -> dict[str, str]:
        """What a process talking to this cluster needs: the mode and the token's file (Ray's own
        client reads them), and no other token of the caller's environment."""
        return {_ray_auth.AUTH_MODE_ENV: _ray_auth.TOKEN, _ray_auth.TOKEN_PATH_ENV: str(self.auth.token_file)}

    def env_for_recipe(self) -> dict[str, str]:
        """A recipe handed this cluster as an external one (MILES_SCRIPT_EXTERNAL_RAY=1), with its token."""
        return {"MILES_SCRIPT_EXTERNAL_RAY": "1", "RAY_ADDRESS": self.address, **self.auth_env()}

    def auth_headers(self) -> dict[str, str]:
        return self.auth.headers()

    def _env(self) -> dict[str, str]:
        env = scrubbed_env()
        env.pop("RAY_ADDRESS", None)
        env[TOKEN_ENV] = self.token
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _run(self, command: str, extra_env: dict[str, str] | None = None) -> None:
        """One `ray start` line (the launcher's own `ray_start_command`), run by bash as the leader
        of a session of its own, which every daemon it starts stays in (`sessions`)."""
        assert self.log_path is not None
        env = _ray_cluster.ray_start_env({**self._env(), **(extra_env or {})}, None, self.auth)
        with open(self.log_path, "a") as log:
            try:
                returncode = _ray_cluster.run_in_own_session(command, env, log, self.sessions.append,
                                                             self.start_timeout, _ray_cluster.raise_open_files_limit)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"`{command}` did not return within {self.start_timeout:.0f}s; see {self.log_path}")
        if returncode != 0:
            raise RuntimeError(f"`{command}` failed with {returncode}; see {self.log_path}:\n"
                               + self.log_path.read_text(errors="replace")[-4000:])

    def _spec(self, head_address: str | None = None) -> "_ray_cluster.RayNodeSpec":
        ports = _ray_cluster.RayPorts.allocate("127.0.0.1")
        if head_address is None:
            self.gcs_port, self.dashboard_port = ports.gcs_port, ports.dashboard_port
        return _ray_cluster.RayNodeSpec(
            "127.0.0.1", ports, str(self.temp_dir), self.gpus_per_node, self.cpus_per_node,
            head_address=head_address, object_store_bytes=self.object_store_bytes,
        )

    def start(self, attempts: int = 3) -> "LocalRayCluster":
        """Start the nodes; a failed start is retried on fresh ports.

        Two things make a start fail on a busy machine, and both pass on a second try: free
        ports are picked, released, then bound by Ray, so a concurrent test can take one in
        between; and a raylet aborts when its dashboard agent (a Python process) has not written
        its port within a limit Ray hard-codes (about 15 s), which an overloaded 2-core machine
        can miss. Ray's configurable start-up limits are raised (`SLOW_MACHINE_TIMEOUTS`).
        """
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self.temp_dir, self.log_path, self._owned_temp = None, None, False
        return self

    def _start_once(self) -> "LocalRayCluster":
        if self.temp_dir is None:
            # Short: Ray puts Unix sockets under it and socket paths are limited to 107 bytes.
            self.temp_dir = Path(tempfile.mkdtemp(prefix="mrc-", dir="/tmp"))
            self._owned_temp = True
        self.log_path = self.log_path or (self.temp_dir / "cluster.log")
        _ray_auth.write_fresh_token(self.auth)
        try:
            self._run(_ray_cluster.ray_start_command(self._spec()))
            for _ in range(self.nodes - 1):
                self._run(_ray_cluster.ray_start_command(self._spec(self.gcs_address)))
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def add_node(self, num_gpus: int | None = None, num_cpus: int | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        """One more node joining the running cluster (a node that comes late), with this
        cluster's resources per node unless told otherwise."""
        spec = dataclasses.replace(self._spec(self.gcs_address),
                                   num_gpus=self.gpus_per_node if num_gpus is None else num_gpus,
                                   num_cpus=self.cpus_per_node if num_cpus is None else num_cpus)
        self._run(_ray_cluster.ray_start_command(spec), extra_env)
        self.nodes += 1

    def alive_nodes(self) -> int:
        """Nodes the head reports alive; 0 while its state API does not answer (why: `last_error`)."""
        url = f"{self.address}/api/v0/nodes?limit=100"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=self.auth_headers()), timeout=15) as resp:
                payload = json.loads(resp.read())
        except (OSError, ValueError) as err:
            self.last_error = f"{url}: {err}"
            return 0
        self.last_error = ""
        return json.dumps(payload).count('"state": "ALIVE"')

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.alive_nodes() >= self.nodes:
                return
            time.sleep(0.5)
        # the log goes into the message: stop() removes the temp dir that holds it
        tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""
        raise RuntimeError(f"Ray cluster did not report {self.nodes} alive nodes within "
                           f"{self.start_timeout:.0f}s (last answer: {self.last_error or 'fewer nodes alive'}, "
                           f"load average {os.getloadavg()[0]:.1f}); log tail:\n{tail}")

    def stop(self) -> tuple[list[str], list[str]]:
        """End every daemon of the cluster (found by token). Returns (ended, survivors).

        A short grace: a test cluster holds nothing to flush, and Ray's daemons sit out any
        SIGTERM grace waiting on each other (processes.TERM_GRACE_S), so 5 s here was 4.5 s of
        every cluster's stop spent waiting for the SIGKILL."""
        ended, survivors = end_processes(self.token, None, grace=0.5, sessions=self.sessions)
        if self._owned_temp and self.temp_dir is not None and not survivors:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return ended, survivors

    def __enter__(self) -> "LocalRayCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
