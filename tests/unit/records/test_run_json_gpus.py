"""run.json names the GPUs the run was given (CUDA_VISIBLE_DEVICES / the lease), not the machine's."""

from __future__ import annotations

import json
import sys
import types

import pytest

from miles.records.run_logging import visible_gpu_entries, write_run_json

UUIDS = [f"GPU-{i}aaa-0000" for i in range(4)]
NAMES = ["H200 #0", "H200 #1", "H200 #2", "H200 #3"]


@pytest.fixture
def four_gpu_machine(monkeypatch):
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "570.1",
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetHandleByUUID=lambda u: UUIDS.index(u),
        nvmlDeviceGetUUID=lambda h: UUIDS[h],
        nvmlDeviceGetName=lambda h: NAMES[h],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)


@pytest.mark.parametrize("visible, expected", [
    (None, NAMES), ("2,3", NAMES[2:]), ("1", NAMES[1:2]), ("", []), ("-1", []),
    ("3,9,0", NAMES[3:4]),  # CUDA stops at the first invalid entry
    ("GPU-2aaa", NAMES[2:3]),  # a UUID prefix
])
def test_gpu_names_follow_cuda_visible_devices(four_gpu_machine, monkeypatch, tmp_path, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    record = write_run_json(tmp_path, ["--x"], resumed=False, start_rollout_id=0, device="cuda")
    assert record["gpu_names"] == expected
    assert json.loads((tmp_path / "run.json").read_text())["gpu_names"] == expected
    assert record["cuda_visible_devices"] == visible
    assert record["versions"]["driver"] == "570.1"


def test_a_cpu_run_on_a_gpu_machine_was_given_no_gpu(four_gpu_machine, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    record = write_run_json(tmp_path, [], resumed=False, start_rollout_id=0, device="cpu")
    assert record["gpu_names"] == [] and record["cuda_visible_devices"] is None


def test_visible_entries():
    assert visible_gpu_entries(None, 2) == ["0", "1"]
    assert visible_gpu_entries("1,0", 2) == ["1", "0"]
    assert visible_gpu_entries("0,5,1", 2) == ["0"]
