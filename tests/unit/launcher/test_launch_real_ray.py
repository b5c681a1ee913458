"""The launcher against real Ray clusters on this host: few tests, each with its own ports and dirs."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from miles.launcher.local_cluster import HEAD_ROLE, WORKER_ROLE, end_recorded_run
from miles.launcher.processes import LaunchRecord, pids_in_session, pids_with_token
from miles.launcher.ray_cluster import free_ports, tcp_reachable

RECIPE = Path(__file__).with_name("example_recipe.py")
SECRET = "wandb-secret-value-1a2b3c"

TINY_TRAIN = textwrap.dedent("""
    import os, sys
    print("TINY TRAIN argv:", " ".join(sys.argv[1:]))
    print("wandb key reached the job:", bool(os.environ.get("WANDB_API_KEY")))
""")


# ... and a Ray task's priority: the workers of our nodes run at niceness 0, not Ray's 15
# (ray_cluster.WORKER_PRIORITY_ENV)
PRIORITY_TRAIN = TINY_TRAIN + textwrap.dedent("""
    import ray
    print("a Ray token in the job's environment:", "RAY_AUTH_TOKEN" in os.environ)
    ray.init()
    print("a Ray worker's niceness:", ray.get(ray.remote(lambda: os.nice(0)).remote()))
""")


@pytest.fixture
def train_script(tmp_path):
    path = tmp_path / "tiny_train.py"
    path.write_text(TINY_TRAIN)
    return path


def _start(argv, log, **env):
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("MILES_SCRIPT_", "RAY_AUTH_")) and k != "WANDB_API_KEY"}
    environ["MILES_SINGLE_HOST_CLUSTER"] = "1"  # head and worker on this one host, on loopback
    environ.update(env)
    return subprocess.Popen([sys.executable, str(RECIPE), *argv], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=environ, start_new_session=True)


def _tokens(*record_dirs_and_roles):
    records = [LaunchRecord.load(d, role) for d, role in record_dirs_and_roles]
    return [r.token for r in records if r is not None]


def _end_everything(procs, records):
    """Teardown: the launchers' records (what a re-run would clean, temp dirs included), then
    the launchers themselves if a test failed halfway. Only what these tests started."""
    for output_dir, role in records:
        end_recorded_run(output_dir, role)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


SWEEP_SECRETS = {  # name -> value; names the launcher's one rule calls secret, plus one given by --secret-env
    "WANDB_API_KEY": SECRET, "HF_TOKEN": "hf-token-value-9z8y7x", "AWS_SECRET_ACCESS_KEY": "aws-secret-value-5k4j3h",
    "GITHUB_PAT": "ghp-pat-value-2q1w0e", "DB_PASSWORD_2": "db-password-value-7u6i5o",
    "CUSTOM_DSN": "postgres://u:dsn-value-3r4t5y@db/x",
}
SECRET_COUNT_TRAIN = textwrap.dedent("""
    import os, sys, time
    print("TINY TRAIN argv:", " ".join(sys.argv[1:]))
    names = sys.argv[sys.argv.index("--secret-names") + 1].split(",")
    print("secrets reached the job:", sum(bool(os.environ.get(n)) for n in names), flush=True)
    hold = sys.argv[sys.argv.index("--hold-until") + 1]
    deadline = time.monotonic() + 120
    while not os.path.exists(hold) and time.monotonic() < deadline:  # the test probes the running cluster
        time.sleep(0.2)
    sys.exit(3)  # with --keep-ray-logs a failed job keeps Ray's temp dir, so every file Ray wrote can be scanned
""")


def _http_status(url, token=None, data=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=data, headers={**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=15) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _gcs_call(gcs_address, token=None):
    """One GCS RPC as any gRPC client would make it: 'OK' or the status code's name."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=15, metadata=metadata)
            return "OK"
        except grpc.RpcError as err:
            return err.code().name


def _listening_ports(pids):
    """{port: {local addresses}} of the TCP sockets `pids` listen on (/proc/net/tcp, tcp6)."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                address, port = local.split(":")
                found.setdefault(int(port, 16), set()).add(address)
    return found


def _cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_loopback_hex(address):
    if len(address) == 8:  # IPv4, little-endian
        return address.endswith("7F")
    return address in ("00000000000000000000000001000000",) or (
        address.startswith("0000000000000000FFFF0000") and address.endswith("7F"))


def _plan_allows(entries, port):
    for entry in entries:
        listed = str(entry["port"])
        low, _, high = listed.partition("-")
        if int(low) <= port <= int(high or low):
            return True
    return False


@pytest.mark.timeout(420)
def test_train_role_waits_for_a_worker_node_a_failed_job_exits_non_zero_and_no_secret_is_in_any_file(tmp_path):
    """Also issue 11's one secret rule: secrets from the shell, --extra-env-vars and --secret-env reach
    the job, and no file Ray or the launcher wrote (Ray's session logs, runtime-env agent logs, the
    plan, job.log, launcher.log) holds any of their values. The job fails on purpose: a failed job
    keeps Ray's temp dir, so every file Ray wrote can be scanned.

    And issue 44's cluster that lets in only its own, while the job holds: the two nodes, started the
    launcher's way, require the head's token (the worker joins with its file); a job submitted or a
    GCS client without it is refused, with it accepted; the token is in no argv (`ps`), in no file
    but its own 0600 file (gone with the cluster); every port the head listens on beyond loopback is
    in the plan, the job server only on loopback, and no Ray client server runs."""
    script = tmp_path / "count_secrets.py"
    script.write_text(SECRET_COUNT_TRAIN)
    hold = tmp_path / "probes_done"
    from_shell = ("WANDB_API_KEY", "HF_TOKEN")
    extra = " ".join(f"{k}={v}" for k, v in SWEEP_SECRETS.items() if k not in from_shell)
    head_port = free_ports(1)[0]
    out, worker_out = tmp_path / "out", tmp_path / "worker"
    train_log, worker_log = tmp_path / "train.log", tmp_path / "worker.log"
    train = _start(["train", "--output-dir", str(out), "--run-id", "r1", "--num-nodes", "2",
                    "--ray-head-port", str(head_port), "--train-script", str(script),
                    "--extra-env-vars", extra, "--secret-env", "CUSTOM_DSN", "--keep-ray-logs",
                    "--extra-args", f"--secret-names {','.join(SWEEP_SECRETS)} --hold-until {hold}"],
                   train_log, **{k: SWEEP_SECRETS[k] for k in from_shell})
    procs = [train]
    try:
        _wait_until(lambda: tcp_reachable("127.0.0.1", head_port), 120, "head never came up")
        ray_plan = json.loads((out / "r1" / "plan.json").read_text())["ray"]
        token_file = Path(ray_plan["auth"]["token_file"])
        worker_argv = ["worker", "--head-address", f"127.0.0.1:{head_port}", "--output-dir", str(worker_out),
                       "--num-cpus", "1"]
        tokenless = subprocess.run([sys.executable, str(RECIPE), *worker_argv], capture_output=True, text=True,
                                   env={k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
                                   | {"MILES_SINGLE_HOST_CLUSTER": "1"}, timeout=60)
        assert tokenless.returncode == 2 and "error: the head requires its token" in tokenless.stderr
        worker = _start(worker_argv, worker_log, RAY_AUTH_TOKEN_PATH=str(token_file))
        procs.append(worker)
        _wait_until(lambda: LaunchRecord.load(worker_out, WORKER_ROLE) is not None, 60, "worker recorded nothing")
        tokens = _tokens((out, HEAD_ROLE), (worker_out, WORKER_ROLE))
        _wait_until(lambda: "secrets reached the job:" in train_log.read_text(), 240, "job never started")

        token = token_file.read_text().strip()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token) == 64
        jobs = f"{ray_plan['job_server']}/api/jobs/"
        rogue = json.dumps({"entrypoint": "echo rogue"}).encode()
        assert _http_status(jobs, data=rogue) == 401 and _http_status(jobs, "0" * 64, data=rogue) == 403
        assert _http_status(jobs, token) == 200
        gcs = f"127.0.0.1:{head_port}"
        assert _gcs_call(gcs) == _gcs_call(gcs, "0" * 64) == "UNAUTHENTICATED" and _gcs_call(gcs, token) == "OK"
        assert token not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
        record = LaunchRecord.load(out, HEAD_ROLE)
        head = set(pids_with_token(record.token)) | set(pids_in_session(record.session))
        assert not [pid for pid in head if b"ray.util.client.server" in _cmdline(pid)]
        listening = _listening_ports(head)
        assert ray_plan["gcs_port"] in listening
        assert all(_is_loopback_hex(a) for a in listening[ray_plan["dashboard_port"]])  # the job server
        routable = sorted(p for p, addresses in listening.items() if not all(map(_is_loopback_hex, addresses)))
        assert ray_plan["gcs_port"] in routable  # Ray's GCS binds every interface: the token is what guards it
        assert [p for p in routable if not _plan_allows(ray_plan["open_to_network"], p)] == []
        hold.touch()

        assert train.wait(timeout=300) == 3, train_log.read_text()[-3000:]
        assert not token_file.exists()  # the cluster is gone, and its token with it
        head_temp_dir = Path(LaunchRecord.load(out, HEAD_ROLE).ray_temp_dir)
        assert head_temp_dir.is_dir()  # kept (--keep-ray-logs): Ray's logs
        assert head_temp_dir == Path(ray_plan["temp_dir"])
        log = train_log.read_text()
        submitted_at = log.index("EXEC: ray job submit")
        assert log.index("cluster ready: ClusterResources(num_nodes=2") < submitted_at
        assert log.index("before submit: job server http://127.0.0.1:") < submitted_at
        assert f"other nodes join 127.0.0.1:{head_port} with RAY_AUTH_TOKEN_PATH={token_file}" in log
        assert "TINY TRAIN argv: --run-dir" in log and "FAILED" in log
        assert f"secrets reached the job: {len(SWEEP_SECRETS)}" in log
        # ... and no file holds a secret (Ray's runtime-env agent logs runtime envs, values included) or the token
        ray_files = [p for p in head_temp_dir.rglob("*") if p.is_file() and not p.is_symlink()]
        out_files = [p for p in [*out.rglob("*"), *worker_out.rglob("*")] if p.is_file() and not p.is_symlink()]
        assert any("session_" in str(p) for p in ray_files) and (out / "r1" / "job.log").is_file()
        leaks = [(name, str(p)) for p in [*ray_files, *out_files, train_log, worker_log]
                 for name, value in [*SWEEP_SECRETS.items(), ("ray token", token)] if value.encode() in p.read_bytes()]
        assert leaks == []

        # the head is gone with the train role; the worker notices and leaves on its own
        assert worker.wait(timeout=90) == 0, worker_log.read_text()[-3000:]
        assert "is gone: leaving" in worker_log.read_text()
        assert len(tokens) == 2 and all(pids_with_token(t) == [] for t in tokens)
    finally:
        _end_everything(procs, [(out, HEAD_ROLE), (worker_out, WORKER_ROLE)])


@pytest.mark.slow  # a launcher-started head to exit 0: the tiny recipe's CPU case (own head) in the README's command
@pytest.mark.timeout(300)
def test_successful_job_exits_0_key_reaches_job_its_workers_run_at_normal_priority_and_cluster_is_ended(tmp_path):
    """Also: tokens an earlier Ray left in ~/.ray and the shell (a temporary HOME) break nothing: the
    head, its job and the job's driver (ray.init) use the head's own token, and none of them sees the
    stale one."""
    train_script = tmp_path / "priority_train.py"
    train_script.write_text(PRIORITY_TRAIN)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("stale-token-an-earlier-ray-init-left-behind")
    out, log_path = tmp_path / "out", tmp_path / "train.log"
    train = _start(["train", "--output-dir", str(out), "--run-id", "r2", "--train-script", str(train_script),
                    "--extra-args", "--diffusion-kl-beta 0.02"], log_path, WANDB_API_KEY=SECRET, HOME=str(home),
                   RAY_AUTH_TOKEN="stale-token-of-the-shell")
    try:
        assert train.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        log = log_path.read_text()
        assert "wandb key reached the job: True" in log
        assert "a Ray worker's niceness: 0" in log  # the driver's ray.init joined with the head's token
        assert "a Ray token in the job's environment: False" in log
        assert [p.name for p in (home / ".ray").iterdir()] == ["auth_token"]
        assert (home / ".ray" / "auth_token").read_text() == "stale-token-an-earlier-ray-init-left-behind"
        assert not (out / "r2" / "ray_auth_token").exists()  # gone with the cluster
        # Ray's banner (and its `ray stop` advice) stays in the launcher's log; the last lines say where results
        # are, the total time and the next step
        assert "ray stop" not in log and "Local node IP" not in log
        results, done = log.strip().splitlines()[-2:]
        assert results.startswith(f"results: run dir {out / 'r2'}") and done.startswith("done in ")
        assert "next: python3 -m miles.export" in done or done.endswith("no checkpoint to export")
        assert "--diffusion-kl-beta 0.02" in log.split("TINY TRAIN argv:")[1].splitlines()[0]
        # both EXEC lines (ray start ~500 characters, ray job submit ~1,500) cut, each naming its file;
        # the file's path is as long as pytest's tmp_path (longer under xdist): the rest is bounded
        execs = [line for line in log.splitlines() if line.startswith("EXEC: ")]
        files = [out / "r2" / "head_command.txt", out / "r2" / "job_command.txt"]
        assert len(execs) == 2 and all(str(f) in line and len(line.replace(str(f), "")) < 300
                                       for line, f in zip(execs, files)), execs
        assert files[0].read_text().split()[2:4] == ["start", "--head"]
        assert files[1].read_text().startswith("ray job submit ") and str(train_script) in files[1].read_text()
        record = LaunchRecord.load(out, HEAD_ROLE)
        assert SECRET not in log
        assert not [p for p in out.rglob("*") if p.is_file() and SECRET in p.read_text()]
        assert pids_with_token(record.token) == []
        assert not Path(record.ray_temp_dir).exists()  # a successful run leaves no Ray temp dir
    finally:
        _end_everything([train], [(out, HEAD_ROLE)])


@pytest.mark.slow  # an external launch: every shared-cluster CPU case and the multinode rehearsal in the README's command
@pytest.mark.timeout(400)
def test_an_external_launch_only_submits_into_a_running_cluster_and_sigterm_to_its_owner_ends_it(tmp_path, train_script):
    """Two launchers on one head (a head costs seconds of CPU to start and to stop): the owner
    starts it and runs a job that sleeps; a second launcher handed that head (MILES_SCRIPT_EXTERNAL_RAY=1,
    RAY_ADDRESS) only submits its job and leaves the cluster running; it joins with the head's token
    (RAY_AUTH_TOKEN_PATH), and without one it is refused in one line. Then SIGTERM to the owner
    stops its job and ends the cluster."""
    sleepy = tmp_path / "sleepy_train.py"
    sleepy.write_text("import time\nprint('JOB STARTED', flush=True)\ntime.sleep(600)\n")
    out, log_path = tmp_path / "out", tmp_path / "train.log"
    ext_out, ext_log = tmp_path / "ext_out", tmp_path / "external.log"
    train = _start(["train", "--output-dir", str(out), "--run-id", "r3", "--train-script", str(sleepy)], log_path)
    procs = [train]
    try:
        _wait_until(lambda: "JOB STARTED" in log_path.read_text(), 200, "job never started")
        record = LaunchRecord.load(out, HEAD_ROLE)
        owner_ray = json.loads((out / "r3" / "plan.json").read_text())["ray"]
        job_server, token_file = owner_ray["job_server"], owner_ray["auth"]["token_file"]
        ext_argv = ["train", "--output-dir", str(ext_out), "--run-id", "r4", "--train-script", str(train_script)]
        no_token_log = tmp_path / "no_token.log"
        no_token = _start(ext_argv, no_token_log, MILES_SCRIPT_EXTERNAL_RAY="1", RAY_ADDRESS=job_server,
                          HOME=str(tmp_path))  # no ~/.ray/auth_token either
        assert no_token.wait(timeout=120) == 2, no_token_log.read_text()[-3000:]
        assert no_token_log.read_text().strip().splitlines()[-1].startswith(
            "error: the Ray cluster requires a token and none in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH")
        external = _start(ext_argv, ext_log, MILES_SCRIPT_EXTERNAL_RAY="1", RAY_ADDRESS=job_server,
                          RAY_AUTH_TOKEN_PATH=token_file)
        procs.append(external)
        assert external.wait(timeout=200) == 0, ext_log.read_text()[-3000:]
        log = ext_log.read_text()
        assert "ray_start.py start" not in log and "TINY TRAIN argv:" in log and "warning" not in log
        assert not (ext_out / ".launcher").exists()
        assert pids_with_token(record.token)  # the cluster it was handed is still up

        train.send_signal(signal.SIGTERM)
        assert train.wait(timeout=90) == 130, log_path.read_text()[-3000:]
        assert "stopping Ray job" in log_path.read_text()
        assert pids_with_token(record.token) == []
        assert not Path(record.ray_temp_dir).exists()  # removed on an interrupted run too (no --keep-ray-logs)
    finally:
        _end_everything(procs, [(out, HEAD_ROLE)])
