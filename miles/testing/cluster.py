"""A throw-away multi-node Ray cluster on loopback, for recipes that expect an external cluster.

Every node is a plain `ray start` with ports and a temp dir of its own, so concurrent tests
(pytest-xdist workers, other pytest processes) never share a cluster. All daemons inherit the
test's token (`MILES_TEST_TOKEN`), which is how `stop()` finds and ends them: never by name,
never with Ray's own stop command (that would end every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from miles.testing.dry import scrubbed_env
from miles.testing.runner import TOKEN_ENV, end_processes, new_token

_PORT_FLAGS = (
    "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (bound together, then released)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _raise_open_files_limit() -> None:
    """In the `ray start` child: soft RLIMIT_NOFILE up to the hard limit (raylets need many)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _ray_cli() -> list[str]:
    exe = Path(sys.executable).with_name("ray")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ray")
    return [found] if found else [sys.executable, "-m", "ray.scripts.scripts"]


@dataclass
class LocalRayCluster:
    """`nodes` Ray nodes on 127.0.0.1: a head (with the job server) and `nodes - 1` workers."""

    nodes: int = 2
    cpus_per_node: int = 2
    gpus_per_node: int = 0
    token: str = field(default_factory=new_token)
    object_store_bytes: int = 100 * 2**20
    start_timeout: float = 120.0
    temp_dir: Path | None = None
    gcs_port: int = 0
    dashboard_port: int = 0
    log_path: Path | None = None
    _owned_temp: bool = False

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def address(self) -> str:
        """The job server's address (what `RAY_ADDRESS` holds for `ray job submit`)."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env_for_recipe(self) -> dict[str, str]:
        return {"MILES_SCRIPT_EXTERNAL_RAY": "1", "RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "disabled"}

    def _env(self) -> dict[str, str]:
        env = scrubbed_env()
        env.pop("RAY_ADDRESS", None)
        env[TOKEN_ENV] = self.token
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["PYTHONUNBUFFERED"] = "1"
        # A ~/.ray/auth_token left by any earlier command turns Ray's token auth on for some
        # processes and not others (a worker then cannot join); this cluster is loopback-only.
        env.setdefault("RAY_AUTH_MODE", "disabled")
        return env

    def _run(self, args: list[str]) -> None:
        assert self.log_path is not None
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(args)}\n".encode())
            log.flush()
            proc = subprocess.run(args, env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=self.start_timeout,
                                  preexec_fn=_raise_open_files_limit)
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(args)}` failed with {proc.returncode}; see {self.log_path}:\n"
                               + self.log_path.read_text(errors="replace")[-4000:])

    def _node_args(self) -> list[str]:
        ports = free_ports(len(_PORT_FLAGS) + 2)
        args = ["--node-ip-address", "127.0.0.1", "--num-cpus", str(self.cpus_per_node),
                "--num-gpus", str(self.gpus_per_node),
                "--object-store-memory", str(self.object_store_bytes), "--disable-usage-stats"]
        for flag, port in zip(_PORT_FLAGS, ports):
            args += [flag, str(port)]
        return args

    def start(self, attempts: int = 2) -> "LocalRayCluster":
        """Start the nodes; a failed start is retried on fresh ports.

        Free ports are picked, released, then bound by Ray, so a concurrent test can take one in
        between: a second attempt with new ports gets past that race.
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
        self.gcs_port, self.dashboard_port, client_port = free_ports(3)
        ray = _ray_cli()
        try:
            self._run(ray + ["start", "--head", "--port", str(self.gcs_port),
                             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                             "--include-dashboard", "true", "--ray-client-server-port", str(client_port),
                             "--temp-dir", str(self.temp_dir), *self._node_args()])
            for _ in range(self.nodes - 1):
                self._run(ray + ["start", "--address", self.gcs_address, *self._node_args()])
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def alive_nodes(self) -> int:
        url = f"{self.address}/api/v0/nodes?limit=100"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                payload = json.loads(resp.read())
        except (OSError, ValueError):
            return 0
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
                           f"{self.start_timeout:.0f}s; log tail:\n{tail}")

    def stop(self) -> tuple[list[str], list[str]]:
        """End every daemon of the cluster (found by token). Returns (ended, survivors)."""
        ended, survivors = end_processes(self.token, None, grace=5.0)
        if self._owned_temp and self.temp_dir is not None and not survivors:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return ended, survivors

    def __enter__(self) -> "LocalRayCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
