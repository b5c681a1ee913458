"""The suite runner on a Ray cluster: a loopback cluster whose worker nodes declare logical GPUs.

One cluster serves the module: a head without GPUs (the runner's driver and its log sink attach
there, so no case can take them down) and worker nodes with 4 logical GPUs each. The cases are
`fixtures/synthetic_case.py`: each records the devices Ray gave it and sleeps for its estimate.
Every process the cluster starts carries the cluster's token; that is how it is ended.
"""

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from miles.testing.cluster import LocalRayCluster

from junit_check import junit_problems

REPO = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).parent / "fixtures" / "synthetic_case.py"
GPUS_PER_NODE = 4
# a dead node is noticed in about two seconds instead of fifteen
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
                      "RAY_health_check_initial_delay_ms": "500"}


class GpuNodes:
    """A loopback cluster: the project's LocalRayCluster as a head without GPUs (the runner's
    driver and log sink attach to the head, so no case can take them down), and worker nodes
    with logical GPUs joined through it (`add_node`), so that stopping the head's cluster ends
    them too."""

    def __init__(self):
        self.head = LocalRayCluster(nodes=1, cpus_per_node=2, gpus_per_node=0)

    def start(self) -> "GpuNodes":
        saved = {k: os.environ.get(k) for k in FAST_HEALTH_CHECKS}
        os.environ.update(FAST_HEALTH_CHECKS)  # the head's GCS reads them at its start
        try:
            self.head.start()
        finally:
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.update({key: value})
        return self

    @property
    def gcs_address(self) -> str:
        return self.head.gcs_address

    def gpu_nodes(self) -> list[dict]:
        url = f"{self.head.address}/api/v0/nodes?limit=100"
        with urllib.request.urlopen(urllib.request.Request(url, headers=self.head.auth_headers()), timeout=5) as resp:
            nodes = json.loads(resp.read())["data"]["result"]["result"]
        return [n for n in nodes if n["state"] == "ALIVE" and (n.get("resources_total") or {}).get("GPU")]

    def add_gpu_node(self) -> None:
        self.head.add_node(num_gpus=GPUS_PER_NODE, num_cpus=GPUS_PER_NODE, extra_env=FAST_HEALTH_CHECKS)

    def ensure_gpu_nodes(self, count: int) -> None:
        while len(self.gpu_nodes()) < count:
            before = len(self.gpu_nodes())
            self.add_gpu_node()
            deadline = time.monotonic() + 60
            while len(self.gpu_nodes()) <= before:
                assert time.monotonic() < deadline, "the added node never joined"
                time.sleep(0.5)

    def stop(self):
        return self.head.stop()


@pytest.fixture(scope="module")
def cluster():
    nodes = GpuNodes().start()
    try:
        yield nodes
    finally:
        ended, survivors = nodes.stop()
        assert not survivors, f"cluster processes outlived stop(): {survivors}"


def synthetic(name, gpus, hold, nodes=1, **flags):
    command = ["{python}", "-S", str(SCRIPT), "--hold", f"{hold:.2f}"]
    command += [f"--{flag.replace('_', '-')}" for flag, on in flags.items() if on]
    entry = {"name": name, "gpus": gpus, "est_time": hold, "timeout": 120, "command": command}
    return {**entry, "nodes": nodes} if nodes > 1 else entry


def forty_cases(seed=0):
    """Two 2-node cases (one the whole cluster), widths 4, 2, 1 on one node; 4-8 s each: long
    enough that the few tenths of a second Ray and a process start take between two cases stay
    within the 10 % allowed on an idle 2-core machine (2-4 s cases measured 1.125)."""
    rng = random.Random(seed)
    shapes = [(8, 2), (4, 2)] + [(4, 1)] * 4 + [(2, 1)] * 12 + [(1, 1)] * 22
    return [synthetic(f"c{i:02d}_{gpus}x{nodes}", gpus, rng.uniform(4.0, 8.0), nodes)
            for i, (gpus, nodes) in enumerate(shapes)]


def run_suite(cluster, tmp_path, entries, *extra, env_address=False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps(entries))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("GITHUB_STEP_SUMMARY", "RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(cluster.head.auth_env())  # the runner joins the cluster with its token, as a user would
    address = []
    if env_address:
        env["MILES_CI_RAY_ADDRESS"] = cluster.gcs_address
    else:
        address = ["--ray-address", cluster.gcs_address]
    cmd = [sys.executable, str(REPO / "ci" / "run_suite.py"), "--suite-json", str(suite), *address,
           "--gpu-wait", "0", "--search-iterations", "300", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    return proc, out


def records(out, entries):
    return {e["name"]: json.loads((out / "results" / f"{e['name']}.json").read_text())
            for e in entries if (out / "results" / f"{e['name']}.json").exists()}


def packing_ratio(entries, recorded):
    """Achieved makespan / max(sum(gpus x measured time) / total GPUs, longest measured case)."""
    starts = [recorded[e["name"]]["started"] for e in entries]
    ends = [recorded[e["name"]]["ended"] for e in entries]
    durations = {e["name"]: recorded[e["name"]]["ended"] - recorded[e["name"]]["started"] for e in entries}
    area = sum(e["gpus"] * durations[e["name"]] for e in entries) / 8
    return (max(ends) - min(starts)) / max(area, max(durations.values()))


def device_problems(entries, recorded):
    """Each case ran once on exactly its count of distinct devices, on the nodes it asked for,
    and no device of a node was held by two cases at once."""
    problems = []
    held = []  # (node, device, start, end, case)
    for e in entries:
        rec = recorded.get(e["name"])
        if rec is None:
            problems.append(f"{e['name']}: never ran")
            continue
        nodes = rec["nodes"]
        devices = [(n["node_id"], g) for n in nodes for g in n["gpus"]]
        if len(set(devices)) != e["gpus"] or len(devices) != e["gpus"]:
            problems.append(f"{e['name']}: got {devices}, needs {e['gpus']}")
        if len({n["node_id"] for n in nodes}) != e.get("nodes", 1):
            problems.append(f"{e['name']}: spans {len(nodes)} nodes, asked for {e.get('nodes', 1)}")
        if rec["cuda_visible_devices"] != ",".join(nodes[0]["gpus"]):
            problems.append(f"{e['name']}: CUDA_VISIBLE_DEVICES {rec['cuda_visible_devices']} "
                            f"is not what Ray assigned ({nodes[0]['gpus']})")
        held += [(node, gpu, rec["started"], rec["ended"], e["name"]) for node, gpu in devices]
    for i, a in enumerate(held):
        for b in held[i + 1:]:
            if a[:2] == b[:2] and a[2] < b[3] and b[2] < a[3]:
                problems.append(f"{a[4]} and {b[4]} both held GPU {a[1]} of node {a[0][:6]}")
    return problems


@pytest.mark.slow  # a packing-ratio measurement (a speed figure); the device hand-out is proven by the tests below
def test_a_forty_case_suite_packs_onto_two_nodes_of_logical_gpus(cluster, tmp_path):
    cluster.ensure_gpu_nodes(2)
    assert len(cluster.gpu_nodes()) == 2, "this test plans for exactly 2 x 4 GPUs"
    entries = forty_cases()
    # alone on the machine: no other xdist worker (a load average can dip below the core count
    # for a minute while the other worker sleeps between its tests' processes)
    alone = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") == "1"
    idle = alone and os.getloadavg()[0] < (os.cpu_count() or 1)
    proc, out = run_suite(cluster, tmp_path, entries, env_address=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert device_problems(entries, records(out, entries)) == []
    assert junit_problems(out / "junit.xml") == []
    summary = (out / "summary.md").read_text()
    assert "passed" in summary.splitlines()[0] and "2 nodes, 8 GPUs" in summary
    ratio = float(re.search(r"achieved makespan [^(]*\([\d.]+s, ratio ([\d.]+)\)", summary).group(1))
    packing = packing_ratio(entries, records(out, entries))
    print(f"achieved makespan ratio {ratio:.3f} (against estimates); {packing:.3f} against the lower bound "
          f"of the cases' measured run times\n{summary.splitlines()[4]}")
    # The summary's ratio divides by the bound of the *estimated* times; a loaded 2-core machine
    # stretches every case past its estimate, which no scheduler can undo. What the scheduler
    # owns is the packing: the makespan against the bound of the times the cases really took.
    # On an idle machine the bound is the 10 %. Inside the full parallel suite (load 5-15 on
    # two cores) each hand-over costs a process start of up to a second, which no dispatch can
    # hide: there the bound only catches the unordered submission this dispatch replaced (1.45-1.7).
    limit = 1.10 if idle else 1.40
    assert packing <= limit, f"packing ratio {packing:.3f} > {limit} (idle machine: {idle})\n{summary}"
    logs = list((out / "logs").glob("*.log"))
    assert len(logs) == len(entries) and all("done" in p.read_text() for p in logs)


@pytest.mark.slow  # shares without a cluster: test_ci_gpu_shares.py; the Ray dispatch: test_ci_cluster_dispatch.py
def test_cases_on_shares_of_a_gpu_run_at_once_and_get_the_runners_variables(cluster, tmp_path, monkeypatch):
    """--gpu-shares on a cluster: each case is a task holding a fraction of one GPU, so three
    cases of 2 GiB on 10 GiB GPUs all run at once on one device each; --case-env carries a
    variable the nodes' scrubbed environment lacks."""
    cluster.ensure_gpu_nodes(1)
    entries = [{**synthetic(f"share{i}", 1, 3.0), "gpu_memory_gib": 2.0} for i in range(3)]
    monkeypatch.setenv("MILES_TEST_MODEL_DIR", str(tmp_path / "models"))
    proc, out = run_suite(cluster, tmp_path, entries, "--gpu-shares", "10", "--gpu-memory-gib", "10",
                          "--case-env", "MILES_TEST_MODEL_DIR")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recorded = records(out, entries)
    assert len(recorded) == 3
    assert all(len(r["cuda_visible_devices"].split(",")) == 1 for r in recorded.values())
    assert max(r["started"] for r in recorded.values()) < min(r["ended"] for r in recorded.values())
    assert {r["model_dir"] for r in recorded.values()} == {str(tmp_path / "models")}
    assert "in shares of 10 per GPU" in (out / "summary.md").read_text()


# In the fault suite (docs/faults.md): it needs a third node and kills two, about 40 s and two node
# starts. The cheaper node-loss check below (a multi-node case's peer dies) runs with the slow tests.
@pytest.mark.faults
def test_a_dead_node_fails_only_its_cases_and_retry_reruns_them_elsewhere(cluster, tmp_path):
    # without retry: the killer's node takes its neighbours with it, the other nodes' pass
    cluster.ensure_gpu_nodes(3)
    entries = [synthetic("killer", 1, 3.0, kill_node=True)]
    entries += [synthetic(f"neighbour{i}", 1, 3.0) for i in range(3 * GPUS_PER_NODE - 1)]
    proc, out = run_suite(cluster, tmp_path / "once", entries)
    assert proc.returncode == 3, proc.stdout[-4000:] + proc.stderr[-4000:]
    cases = junit_cases(out)
    lost = {name for name, case in cases.items() if "node lost" in error_message(case)}
    # the killer's node holds up to GPUS_PER_NODE cases when it dies; on a loaded machine a
    # neighbour may not have been placed there yet, so it is not lost (it runs elsewhere, later)
    assert "killer" in lost and 1 <= len(lost) <= GPUS_PER_NODE, sorted(lost)
    dead = node_of(cases["killer"])
    assert all(node_of(cases[name]) == dead for name in lost)
    assert all(cases[name].find("error") is None for name in set(cases) - lost)
    # the log tail came with it -- unless the node died before its log sink had forwarded the case's
    # last lines (seen once in a full suite: an empty tail): a dead node takes its unsent output along
    tail_text = cases["killer"].find("error").text or ""
    assert "ending raylet" in tail_text or not tail_text.strip(), tail_text
    summary = (out / "summary.md").read_text()
    assert f"{len(lost)} lost with their node" in summary.splitlines()[0]

    # with --retry-lost 1 on the two nodes left: the lost cases pass on the other node
    entries = entries[:2 * GPUS_PER_NODE]
    proc, out = run_suite(cluster, tmp_path / "retry", entries, "--retry-lost", "1")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recorded = records(out, entries)
    rerun = {name for name, rec in recorded.items() if rec["attempt"] == 2}
    assert "killer" in rerun and 1 <= len(rerun) <= GPUS_PER_NODE, sorted(rerun)
    # every rerun went to the one node left; a neighbour that finished on the killer's node before
    # it died was not rerun, so that node may be among the non-rerun cases' nodes as well
    survivor = {rec["node_id"] for name, rec in recorded.items() if name not in rerun}
    rerun_nodes = {recorded[name]["node_id"] for name in rerun}
    assert len(rerun_nodes) == 1 and rerun_nodes <= survivor, (rerun_nodes, survivor)
    summary = (out / "summary.md").read_text()
    assert f"{len(rerun)} cases lost with them, {len(rerun)} rerun elsewhere" in summary
    assert summary.count("(rerun: node lost)") == len(rerun)
    assert junit_problems(out / "junit.xml") == []


@pytest.mark.slow  # a lost node's cases requeued: test_ci_cluster_dispatch.py; real node deaths: the fault suite
def test_a_multi_node_case_whose_second_node_dies_is_lost_and_ended(cluster, tmp_path):
    # the lead's own node lives on; the node holding the other bundle dies under it
    cluster.ensure_gpu_nodes(2)
    entries = [synthetic("spread", 2, 3.0, nodes=2, kill_peer_node=True),
               synthetic("bystander", 1, 3.0)]
    started = time.monotonic()
    proc, out = run_suite(cluster, tmp_path, entries)
    assert proc.returncode == 3, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert time.monotonic() - started < 100, "the runner waited for the lead's 120 s sleep"
    cases = junit_cases(out)
    assert "node lost" in error_message(cases["spread"]), error_message(cases["spread"])
    assert "ending raylet" in cases["spread"].find("error").text  # its log tail came with it
    assert cases["bystander"].find("error") is None or "node lost" in error_message(cases["bystander"])


def junit_cases(out):
    import xml.etree.ElementTree as ET

    root = ET.parse(out / "junit.xml").getroot()
    return {c.get("name"): c for c in root.iter("testcase")}


def error_message(case):
    node = case.find("error")
    return node.get("message") if node is not None else ""


def node_of(case):
    return next(p.get("value") for p in case.iter("property") if p.get("name") == "node")
