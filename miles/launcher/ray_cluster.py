"""A Ray node of our own: free ports, a short temp dir, the `ray start` command, and waiting for
a cluster to hold the resources a job needs. Ray itself is imported only where it is needed."""

from __future__ import annotations

import os
import resource
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from miles.launcher.multinode import is_loopback
from miles.launcher.ray_auth import ClusterAuth, headers_for
from miles.utils.ports import free_port_range, free_ports  # noqa: F401  (free_ports: also the launcher's)

# Ray puts unix sockets under its temp dir and socket paths are limited to ~107 bytes, so the
# dir must stay short: never under the (possibly deep) output dir.
_TEMP_ROOT = "/tmp"
_WORKER_PORT_COUNT = 100
MIN_OPEN_FILES = 65536
LOOPBACK = "127.0.0.1"
# `ray start` run by the launcher's own interpreter, with the Ray client server off (ray_start.py)
RAY_START = (sys.executable, str(Path(__file__).with_name("ray_start.py")), "start")


@dataclass(frozen=True)
class RayPorts:
    """Every port a Ray node listens on; 0 means 'picked when the node starts' (dry run)."""

    gcs_port: int = 0
    dashboard_port: int = 0
    node_manager_port: int = 0
    object_manager_port: int = 0
    dashboard_agent_listen_port: int = 0
    dashboard_agent_grpc_port: int = 0
    metrics_export_port: int = 0
    runtime_env_agent_port: int = 0
    min_worker_port: int = 0
    max_worker_port: int = 0

    @classmethod
    def allocate(cls, host: str = "127.0.0.1", gcs_port: int | None = None) -> RayPorts:
        names = [n for n in cls.__dataclass_fields__ if n not in ("min_worker_port", "max_worker_port")]
        if gcs_port:
            names.remove("gcs_port")
        singles = dict(zip(names, free_ports(len(names), host, avoid={gcs_port} if gcs_port else set()), strict=True))
        if gcs_port:
            singles["gcs_port"] = gcs_port
        low = free_port_range(_WORKER_PORT_COUNT, host=host, avoid=set(singles.values()))
        return cls(**singles, min_worker_port=low, max_worker_port=low + _WORKER_PORT_COUNT - 1)


def ray_temp_dir_for(token: str) -> str:
    return f"{_TEMP_ROOT}/mray-{token[:12]}"


@dataclass(frozen=True)
class RayNodeSpec:
    """How to start one Ray node: a head (head_address None) or a node joining a head."""

    node_ip: str | None  # None: let Ray pick the node's address (a worker on another host)
    ports: RayPorts
    temp_dir: str
    num_gpus: int
    num_cpus: int | None = None
    head_address: str | None = None
    object_store_bytes: int | None = None  # None: Ray's default share of memory
    # where a head's dashboard and job server listen: loopback unless asked (jobs are submitted on the head)
    dashboard_host: str = LOOPBACK

    @property
    def is_head(self) -> bool:
        return self.head_address is None

    @property
    def gcs_address(self) -> str:
        return self.head_address or f"{self.node_ip}:{self.ports.gcs_port}"

    @property
    def job_server_url(self) -> str:
        host = LOOPBACK if self.dashboard_host in ("0.0.0.0", "::", "localhost") else self.dashboard_host
        return f"http://{host}:{self.ports.dashboard_port}"

    def plan_entry(self) -> dict:
        return {**asdict(self.ports), "temp_dir": self.temp_dir, "node_ip": self.node_ip,
                "num_gpus": self.num_gpus, "num_cpus": self.num_cpus, "head_address": self.head_address,
                "dashboard_host": self.dashboard_host}


def cpu_job_num_cpus(num_gpus_per_node: int) -> int | None:
    """A CPU job advertises every logical CPU; a GPU job lets Ray count them itself."""
    return (os.cpu_count() or 1) if num_gpus_per_node == 0 else None


def ray_start_command(spec: RayNodeSpec, cuda_visible_devices: str | None = None) -> str:
    p = spec.ports
    words = list(RAY_START)
    if spec.is_head:
        words += ["--head", f"--port={p.gcs_port}", f"--dashboard-host={spec.dashboard_host}",
                  f"--dashboard-port={p.dashboard_port}", "--include-dashboard=true"]
    else:
        words += [f"--address={spec.head_address}"]
    if spec.node_ip:
        words.append(f"--node-ip-address={spec.node_ip}")
    words += [
        f"--node-manager-port={p.node_manager_port}",
        f"--object-manager-port={p.object_manager_port}",
        f"--dashboard-agent-listen-port={p.dashboard_agent_listen_port}",
        f"--dashboard-agent-grpc-port={p.dashboard_agent_grpc_port}",
        f"--metrics-export-port={p.metrics_export_port}",
        f"--runtime-env-agent-port={p.runtime_env_agent_port}",
        f"--min-worker-port={p.min_worker_port}",
        f"--max-worker-port={p.max_worker_port}",
        f"--temp-dir={spec.temp_dir}",
        f"--num-gpus={spec.num_gpus}",
    ]
    if spec.num_cpus is not None:
        words.append(f"--num-cpus={spec.num_cpus}")
    if spec.object_store_bytes is not None:
        words.append(f"--object-store-memory={spec.object_store_bytes}")
    words.append("--disable-usage-stats")
    prefix = f"CUDA_VISIBLE_DEVICES={shlex.quote(cuda_visible_devices)} " if cuda_visible_devices else ""
    return prefix + shlex.join(words)


# What a Ray 2.60 head listens on beyond loopback, whatever --node-ip-address says (Ray turns
# 127.0.0.1 into the host's routable address, and its gRPC servers bind every interface); seen
# with `ss -ltnp` on a head of ours. Ray's --dashboard-host is the one bind address it lets us
# choose. (port field or fixed port, service, where it binds, checks the token, why it is open)
_HEAD_OPEN_PORTS = (
    ("gcs_port", "GCS (--port)", "every interface", True, "every node joins the cluster and every driver connects here"),
    ("node_manager_port", "raylet (--node-manager-port)", "every interface", True,
     "the node's scheduler: other nodes lease its workers and place tasks and actors here"),
    ("object_manager_port", "object manager (--object-manager-port)", "every interface", True,
     "objects move between nodes"),
    ("dashboard_agent_grpc_port", "dashboard agent gRPC (--dashboard-agent-grpc-port)", "every interface", True,
     "the node's agent: metrics, events and job supervision"),
    ("dashboard_agent_listen_port", "dashboard agent HTTP (--dashboard-agent-listen-port)", "the node's address",
     True, "the job server reaches each node's agent"),
    ("runtime_env_agent_port", "runtime env agent (--runtime-env-agent-port)", "the node's address", True,
     "the raylet has runtime envs set up here"),
    ("worker_ports", "workers (--min-worker-port..--max-worker-port)", "every interface", True,
     "each worker's RPC server: drivers and actors on any node call it"),
    ("metrics_export_port", "metrics export (--metrics-export-port)", "every interface", False,
     "Prometheus metrics of the node, read-only"),
    (44217, "autoscaler metrics (Ray's fixed AUTOSCALER_METRIC_PORT)", "every interface", False,
     "Prometheus metrics, read-only; only the first head on a host gets the port"),
    (44227, "dashboard metrics (Ray's fixed DASHBOARD_METRIC_PORT)", "every interface", False,
     "Prometheus metrics, read-only; only the first head on a host gets the port"),
)


def open_to_network(spec: RayNodeSpec, auth: ClusterAuth) -> list[dict]:
    """Every port the head `spec` opens on a routable address, where it binds, whether the
    cluster's token guards it, and why it is open (the plan lists them). The dashboard and job
    server are listed only when asked to bind beyond loopback; the Ray client server is off."""
    p = spec.ports
    entries = []
    for port, service, binds, checks_token, why in _HEAD_OPEN_PORTS:
        if port == "worker_ports":
            port = f"{p.min_worker_port}-{p.max_worker_port}"
        elif isinstance(port, str):
            port = getattr(p, port)
        entries.append({"port": port, "service": service, "binds": binds, "token": checks_token and auth.enabled,
                        "why": why})
    if not is_loopback(spec.dashboard_host):
        entries.append({"port": p.dashboard_port, "service": "dashboard and job server (--dashboard-port)",
                        "binds": spec.dashboard_host, "token": auth.enabled,
                        "why": f"asked for by --dashboard-host {spec.dashboard_host} (MILES_SCRIPT_RAY_DASHBOARD_HOST)"})
    return entries


def ray_start_env(base: Mapping[str, str], cuda_visible_devices: str | None, auth: ClusterAuth) -> dict[str, str]:
    """`ray start`'s own environment: the raylet schedules GPUs from the CUDA_VISIBLE_DEVICES it
    sees at start; set per job or actor it never reaches the scheduler. The node, and every
    process it starts, names the cluster's auth explicitly (ray_auth): whatever token a shell or
    ~/.ray holds never decides it."""
    env = auth.node_env(base)
    env.pop("RAY_ADDRESS", None)  # would make `ray start` look for some other cluster
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    for name, value in {**WORKER_PRIORITY_ENV, **NO_PRESTARTED_WORKERS_ENV}.items():
        env.setdefault(name, value)
    env.update(SLOW_MACHINE_TIMEOUTS)
    if cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


# Ray starts its worker processes at niceness 15, so that its own daemons win the CPU from them. In
# a training job the workers are the job (train ranks, engines, reward workers: the driver, at 0,
# mostly waits on them), and a niced rank loses nearly all of its CPU to any process at normal
# priority that wants the same core: on a shared 2-core machine the Ray train step measured 0.91
# of the same step in a plain process (benchmarks/bench_trainer.py), at 0 the same. Our nodes
# start their workers at normal priority; a caller's own RAY_worker_niceness still wins.
WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "0"}

# Ray starts a worker per CPU ahead of demand when the first driver connects (on our head: the job
# server's, at submission). Those workers carry no runtime env, and every process of our job does
# (the job's env vars), so Ray never hands them an actor: on the tiny CPU run they were two idle
# processes importing Ray beside the job supervisor and the driver, and a node with 100 CPUs
# would start 100. Our nodes start a worker when an actor or task asks for one.
NO_PRESTARTED_WORKERS_ENV = {"RAY_prestart_worker_first_driver": "0", "RAY_enable_worker_prestart": "0"}


# A node starts about fifteen Python processes (the dashboard runs each of its nine modules as
# one). On a loaded machine (a parallel test suite on two cores, load 10-18) their imports take
# minutes, while Ray's start-up limits assume seconds: a dashboard module gets 30 s to report
# ready and the dashboard 60 s (missing either takes the job server and the state API down, and
# the cluster looks empty: "second node not reported alive"); the raylet aborts when the
# dashboard agent has not registered its ports in time (seen: "Check failed" in
# WaitForDashboardAgentPorts, raylet gone); a worker that registers late is killed. Start-up may
# be slow, it must not break. Liveness checks of running nodes keep Ray's defaults, so a dead
# node is still noticed within seconds.
SLOW_MACHINE_TIMEOUTS = {
    "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "600",
    "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "600",
    "RAY_agent_register_timeout_ms": "600000",
    "RAY_raylet_start_wait_time_s": "600",
    "RAY_worker_register_timeout_seconds": "600",
}


def run_in_own_session(command: str, env: Mapping[str, str], log: IO[str], on_session: Callable[[int], None],
                       timeout: float | None = None, preexec_fn: Callable[[], object] | None = None) -> int:
    """`command` (a `ray start` line) run by bash as the leader of a session of its own, which
    every daemon it starts stays in: cleanup finds them there, also those Ray starts without our
    token (a raylet's agents; miles.launcher.processes). `on_session(pid)` records the
    session before anything is started. Returns the exit code; past `timeout` bash is killed and
    subprocess.TimeoutExpired raised (what it started stays in the recorded session)."""
    log.write(f"$ {command}\n")
    log.flush()
    proc = subprocess.Popen(["bash", "-c", command], env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec_fn)
    on_session(proc.pid)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def raise_open_files_limit(minimum: int = MIN_OPEN_FILES) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the raylet inherits it); warn if still low.

    A raylet out of descriptors dies much later with a misleading 'Socket closed' error.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < minimum:
        print(
            f"WARNING: open-files limit is {soft} (hard limit {hard}), below {minimum}. Ray's raylet "
            f"inherits it and may die later with 'Socket closed'; raise it (ulimit -n / limits.conf).",
            file=sys.stderr, flush=True,
        )
    return soft


def wait_for_gcs(host: str, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not tcp_reachable(host, port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray GCS at {host}:{port} not reachable after {timeout:.0f}s")
        time.sleep(0.5)


def tcp_reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ClusterResources:
    num_nodes: int
    num_gpus: float
    num_cpus: float

    def covers(self, num_gpus: float, num_cpus: float, num_nodes: int) -> bool:
        return self.num_gpus >= num_gpus and self.num_cpus >= num_cpus and self.num_nodes >= num_nodes


def alive_nodes(job_server_url: str) -> list:
    """The cluster's alive nodes (Ray's NodeState), from its state API, with the cluster's token
    (ray_auth.headers_for); no Ray driver is started."""
    from ray.util.state import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    client = StateApiClient(job_server_url, headers={"Content-Type": "application/json", **headers_for(job_server_url)})
    nodes = client.list(StateResource.NODES, options=ListApiOptions(), raise_on_missing_output=False)
    return [n for n in nodes if n.state == "ALIVE"]


def cluster_resources(job_server_url: str) -> ClusterResources:
    """Alive nodes and their total GPUs/CPUs, from the dashboard (no Ray driver is started)."""
    nodes = alive_nodes(job_server_url)
    total = lambda key: sum((n.resources_total or {}).get(key, 0.0) for n in nodes)  # noqa: E731
    return ClusterResources(num_nodes=len(nodes), num_gpus=total("GPU"), num_cpus=total("CPU"))


def wait_for_cluster_resources(
    address: str,
    *,
    num_gpus: float = 0,
    num_cpus: float = 0,
    num_nodes: int = 1,
    timeout: float = 600.0,
    poll_s: float = 2.0,
) -> ClusterResources:
    """Block until the cluster behind the job server `address` (http://host:port) has at least
    these totals; raise TimeoutError naming what is missing."""
    deadline = time.monotonic() + timeout
    seen = None
    while True:
        try:
            seen = cluster_resources(address)
        except Exception as err:  # the dashboard may still be starting
            print(f"waiting for cluster at {address}: {err}", flush=True)
        if seen is not None and seen.covers(num_gpus, num_cpus, num_nodes):
            print(f"cluster ready: {seen}", flush=True)
            return seen
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"cluster at {address} has {seen} after {timeout:.0f}s; "
                f"needed num_nodes>={num_nodes}, num_gpus>={num_gpus}, num_cpus>={num_cpus}"
            )
        time.sleep(poll_s)


# -- what a node really has, and whether the cluster can hold the run's layout -----------------

CUDA_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class VisibleGpus:
    count: int
    how: str  # where the count comes from, for the refusal line


def nvml_gpu_count() -> tuple[int, str]:
    """GPUs NVML sees on this machine (0, with the reason, when NVML cannot be used)."""
    try:
        import pynvml
    except ImportError:
        return 0, "no GPU found (pynvml is not installed)"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded: no GPU driver here
        return 0, f"no GPU found (NVML: {type(err).__name__})"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        return count, f"NVML sees {count} GPU(s)"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def visible_gpus(cuda_visible_devices: str | None = None, environ=None, nvml=nvml_gpu_count) -> VisibleGpus:
    """The GPUs a Ray node started here may declare: those NVML sees, narrowed to
    CUDA_VISIBLE_DEVICES (the --cuda-visible-devices option's, else the environment's) when set.
    Listing a device does not make it exist: the count never exceeds NVML's."""
    environ = os.environ if environ is None else environ
    physical, source = nvml()
    listed = cuda_visible_devices if cuda_visible_devices else environ.get(CUDA_VISIBLE_DEVICES_ENV)
    if listed is None:
        return VisibleGpus(physical, source)
    entries = [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    count = min(len(entries), physical)
    return VisibleGpus(count, f"{source}; {CUDA_VISIBLE_DEVICES_ENV}={listed} lists {len(entries)}")


def declared_gpus(num_gpus_per_node: int, visible: VisibleGpus) -> int:
    """`ray start --num-gpus`: what the recipe uses of what the machine has, never more."""
    return min(num_gpus_per_node, visible.count)


def this_machine(num_gpus: int, num_cpus: int | None) -> list:
    """The offer of a head this launcher starts and no node joins: this machine as it declares it."""
    from miles.plan.resource_fit import NodeOffer

    return [NodeOffer("this machine", {"GPU": float(num_gpus), "CPU": float(num_cpus or os.cpu_count() or 1)})]


def alive_node_offers(job_server_url: str) -> list:
    """The cluster's alive nodes and their totals, from the dashboard (no Ray driver)."""
    from miles.plan.resource_fit import NodeOffer

    nodes = alive_nodes(job_server_url)
    return [NodeOffer(n.node_ip or n.node_id[:12],
                      {k: float(v) for k, v in (n.resources_total or {}).items() if k in ("GPU", "CPU", "memory")})
            for n in nodes]


def layout_verdict(train_args, nodes: list):
    """The run's layout (train_diffusion.py's parsed flags) judged against `nodes`, by the same
    rule the driver applies before it waits for its placement group (miles.plan.resource_fit)."""
    from miles.plan.placement_plan import layout_requests, plan_placement
    from miles.plan.resource_fit import judge

    cpus = sum(n.resources.get("CPU", 0.0) for n in nodes) if train_args.device == "cpu" else None
    try:
        plan = plan_placement(train_args, cpus)
    except ValueError as err:  # a CPU layout that fits no CPU count of this cluster
        from miles.plan.resource_fit import NEVER, Verdict

        return Verdict(NEVER, f"{err}; the cluster offers {len(nodes)} node(s)", tuple(nodes))
    return judge(layout_requests(train_args, plan), nodes, expected_nodes=train_args.num_nodes)
