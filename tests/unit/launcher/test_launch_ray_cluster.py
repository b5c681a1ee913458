import os
import shlex
import subprocess
import sys
from pathlib import Path

from miles.launcher import ray_cluster
from miles.launcher.ray_auth import ClusterAuth, own_cluster_auth
from miles.launcher.ray_cluster import (
    RayNodeSpec,
    RayPorts,
    cpu_job_num_cpus,
    free_ports,
    open_to_network,
    ray_start_command,
    ray_start_env,
    ray_temp_dir_for,
)

AUTH = own_cluster_auth("/run/r1", environ={})


def test_allocated_ports_are_distinct_and_worker_range_avoids_them():
    ports = RayPorts.allocate()
    singles = [v for k, v in vars(ports).items() if not k.endswith("worker_port")]
    assert len(set(singles)) == len(singles) and all(singles)
    assert ports.max_worker_port - ports.min_worker_port == 99
    assert not any(ports.min_worker_port <= p <= ports.max_worker_port for p in singles)


def test_allocated_ports_lie_below_the_ephemeral_range_so_no_outgoing_connection_takes_one():
    # Linux hands out 32768-60999 for outgoing connections; a port picked there can be taken
    # between the pick and the daemon's bind (a raylet then dies and `ray start` never returns)
    for _ in range(20):
        ports = RayPorts.allocate(gcs_port=6390)
        assert ports.gcs_port == 6390
        assert all(0 < p < 32768 for p in vars(ports).values())


def test_head_command_names_every_port_and_its_own_temp_dir():
    spec = RayNodeSpec("127.0.0.1", RayPorts.allocate(gcs_port=free_ports(1)[0]), ray_temp_dir_for("f" * 16), 4)
    command = ray_start_command(spec)
    for flag in ("--head", "--port=", "--dashboard-port=", "--node-manager-port=", "--object-manager-port=",
                 "--dashboard-agent-listen-port=", "--dashboard-agent-grpc-port=",
                 "--metrics-export-port=", "--runtime-env-agent-port=", "--min-worker-port=", "--max-worker-port=",
                 f"--temp-dir={spec.temp_dir}", "--num-gpus=4"):
        assert flag in command, flag
    assert "=0 " not in command


def test_temp_dir_is_short_enough_for_ray_unix_sockets():
    # Ray appends about 70 characters (session dir + socket name) and sockets allow ~107
    assert len(ray_temp_dir_for("0123456789abcdef")) + 70 < 107


def test_cpu_job_starts_head_with_zero_gpus_and_every_logical_cpu():
    spec = RayNodeSpec("127.0.0.1", RayPorts(), "/tmp/mray-x", 0, cpu_job_num_cpus(0))
    command = ray_start_command(spec)
    assert "--num-gpus=0" in command and f"--num-cpus={os.cpu_count()}" in command
    assert cpu_job_num_cpus(8) is None


def test_cuda_visible_devices_goes_into_ray_starts_own_environment():
    spec = RayNodeSpec("127.0.0.1", RayPorts(), "/tmp/mray-x", 2)
    assert ray_start_command(spec, "0,1").startswith(f"CUDA_VISIBLE_DEVICES=0,1 {shlex.quote(sys.executable)} ")
    env = ray_start_env({"RAY_ADDRESS": "elsewhere:1", "PATH": "/bin"}, "0,1", AUTH)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "RAY_ADDRESS" not in env


def test_our_nodes_start_their_workers_at_normal_priority_unless_the_caller_set_one():
    assert ray_start_env({"PATH": "/bin"}, None, AUTH)["RAY_worker_niceness"] == "0"
    assert ray_start_env({"RAY_worker_niceness": "5"}, None, AUTH)["RAY_worker_niceness"] == "5"


def test_our_nodes_prestart_no_worker_the_job_could_never_use():
    env = ray_start_env({"PATH": "/bin"}, None, AUTH)
    assert env["RAY_prestart_worker_first_driver"] == env["RAY_enable_worker_prestart"] == "0"


def test_joining_node_points_at_the_head_and_is_not_a_head():
    spec = RayNodeSpec("127.0.0.1", RayPorts.allocate(), "/tmp/mray-y", 0, 1, head_address="127.0.0.1:6399")
    command = ray_start_command(spec)
    assert "--address=127.0.0.1:6399" in command and "--head" not in command


def test_low_open_files_limit_is_raised_to_hard_limit_and_warned_about():
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024));"
        "from miles.launcher.ray_cluster import raise_open_files_limit;"
        "print('soft', raise_open_files_limit())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "soft 1024" in result.stdout
    assert "WARNING: open-files limit is 1024" in result.stderr


def test_node_without_an_address_lets_ray_pick_it():
    spec = RayNodeSpec(None, RayPorts.allocate("0.0.0.0"), "/tmp/mray-z", 0, head_address="10.0.0.1:6379")
    assert "--node-ip-address" not in ray_start_command(spec)


def test_every_node_runs_rays_own_start_from_the_launchers_interpreter_and_a_head_opens_no_client_server():
    head = RayNodeSpec("10.0.0.7", RayPorts.allocate(), "/tmp/mray-h", 0)
    worker = RayNodeSpec(None, RayPorts.allocate(), "/tmp/mray-w", 0, head_address="10.0.0.7:6379")
    for spec in (head, worker):
        words = shlex.split(ray_start_command(spec))
        assert words[:3] == [sys.executable, str(Path(ray_cluster.__file__).with_name("ray_start.py")), "start"]
        assert not [w for w in words if "client-server" in w]


def test_a_routable_heads_dashboard_and_job_server_stay_on_loopback_unless_asked():
    ports = RayPorts.allocate()
    head = RayNodeSpec("10.0.0.7", ports, "/tmp/mray-h", 0)
    assert "--dashboard-host=127.0.0.1" in ray_start_command(head) and "--node-ip-address=10.0.0.7" in ray_start_command(head)
    assert head.job_server_url == f"http://127.0.0.1:{ports.dashboard_port}"
    assert ports.dashboard_port not in [e["port"] for e in open_to_network(head, AUTH)]
    wide = RayNodeSpec("10.0.0.7", ports, "/tmp/mray-h", 0, dashboard_host="0.0.0.0")
    listed = {e["port"]: e for e in open_to_network(wide, AUTH)}
    assert listed[ports.dashboard_port]["token"] and "MILES_SCRIPT_RAY_DASHBOARD_HOST" in listed[ports.dashboard_port]["why"]


def test_the_plan_lists_each_port_a_head_opens_beyond_loopback_with_why_and_whether_the_token_guards_it():
    ports = RayPorts.allocate()
    listed = {e["port"]: e for e in open_to_network(RayNodeSpec("10.0.0.7", ports, "/tmp/mray-h", 0), AUTH)}
    for port in (ports.gcs_port, ports.node_manager_port, ports.object_manager_port, ports.dashboard_agent_grpc_port,
                 ports.dashboard_agent_listen_port, ports.runtime_env_agent_port,
                 f"{ports.min_worker_port}-{ports.max_worker_port}"):
        assert listed[port]["token"] and listed[port]["why"], port
    assert not listed[ports.metrics_export_port]["token"]  # Prometheus metrics: read-only, Ray checks no token
    unguarded = open_to_network(RayNodeSpec("10.0.0.7", ports, "/tmp/mray-h", 0), ClusterAuth("disabled"))
    assert not any(e["token"] for e in unguarded)


def test_a_node_names_its_clusters_token_file_and_drops_any_token_the_shell_holds():
    env = ray_start_env({"PATH": "/bin", "RAY_AUTH_TOKEN": "stale-token-value", "RAY_AUTH_TOKEN_PATH": "/old",
                         "RAY_AUTH_MODE": "disabled"}, None, AUTH)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == "/run/r1/ray_auth_token"
    assert "RAY_AUTH_TOKEN" not in env
