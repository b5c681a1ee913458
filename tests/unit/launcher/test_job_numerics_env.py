"""The CPU numerics pins (miles/utils/numerics.py) reach CPU runs only: a GPU recipe's job env and
its Ray head's environment carry the documented host thread count instead, while the same
recipe's CPU tier keeps every pin."""

import json
import os
import subprocess
import sys
from pathlib import Path

from miles.launcher.env_vars import build_job_env_vars
from miles.launcher.local_cluster import node_env
from miles.launcher.ray_auth import ClusterAuth
from miles.utils.numerics import GPU_JOB_ENV, GPU_PROCESS_CPU_THREADS, PINNED_ENV

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "scripts/run_diffusion_nft_sd3_pickscore.py"
ISA_PINS = [name for name in PINNED_ENV if not name.endswith("_NUM_THREADS")]


def _dry_plan(tmp_path: Path, scale: str) -> dict:
    """The recipe's dry run at `scale`, started from a pinned process as the harness starts it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_") and k != "WANDB_API_KEY"}
    environ.update(PINNED_ENV)
    environ.update({"MILES_SCRIPT_ENABLE_RAY_SUBMIT": "0", "HOME": str(tmp_path / "home")})
    out = tmp_path / scale
    proc = subprocess.run([sys.executable, str(RECIPE), "--scale", scale, "--output-dir", str(out), "--run-id", "r"],
                          env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "r" / "plan.json").read_text())


def test_a_gpu_recipe_plans_no_cpu_pins_and_its_cpu_tier_keeps_them(tmp_path):
    gpu = _dry_plan(tmp_path, "gpu-proxy")
    cpu = _dry_plan(tmp_path, "cpu-proxy")
    assert "--device" in gpu["argv"] and gpu["argv"][gpu["argv"].index("--device") + 1] == "cuda"
    gpu_env, cpu_env = gpu["runtime_env"]["env_vars"], cpu["runtime_env"]["env_vars"]
    assert [name for name in ISA_PINS if name in gpu_env] == []
    assert gpu_env["OMP_NUM_THREADS"] == gpu_env["MKL_NUM_THREADS"] == str(GPU_PROCESS_CPU_THREADS)
    assert {name: cpu_env.get(name) for name in PINNED_ENV} == PINNED_ENV


def test_job_env_pins_follow_the_device(tmp_path):
    cpu = build_job_env_vars(tmp_path, {}, environ={}, device="cpu")
    gpu = build_job_env_vars(tmp_path, {}, environ={}, device="cuda")
    assert {k: cpu[k] for k in PINNED_ENV} == PINNED_ENV
    assert {k: gpu.get(k) for k in PINNED_ENV} == {k: GPU_JOB_ENV.get(k) for k in PINNED_ENV}


def test_extra_env_vars_still_set_a_pin_on_a_gpu_job(tmp_path):
    env = build_job_env_vars(tmp_path, {"ATEN_CPU_CAPABILITY": "avx2"}, environ={}, device="cuda")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"


def test_a_gpu_node_starts_without_the_pins_a_pinned_launcher_holds():
    launcher = {**PINNED_ENV, "PATH": "/bin", "MKL_CBWR": "COMPATIBLE"}  # one value the user chose
    auth = ClusterAuth("token", token_file="/run/ray_auth_token")
    gpu_node = node_env("tok", "0,1", {"WANDB_API_KEY": "k"}, gpu_node=True, environ=launcher, auth=auth)
    cpu_node = node_env("tok", None, gpu_node=False, environ=launcher, auth=auth)
    assert [name for name in PINNED_ENV if name in gpu_node] == ["MKL_CBWR"]
    assert gpu_node["MKL_CBWR"] == "COMPATIBLE" and gpu_node["PATH"] == "/bin"
    assert gpu_node["WANDB_API_KEY"] == "k" and gpu_node["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert {name: cpu_node[name] for name in PINNED_ENV if name != "MKL_CBWR"} == {
        k: v for k, v in PINNED_ENV.items() if k != "MKL_CBWR"}
