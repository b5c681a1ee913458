"""Several cases on one GPU (--gpu-shares): how many shares a case takes, which cases the packer
starts together on the device, and that the runner really runs them at once on it."""

import json

import pytest

from ci import run_suite
from ci.cases import Case
from ci.gpu_shares import ShareSpec, devices_of, on_shares, ray_gpu_request, share_labels
from ci.runner import RunSettings, case_argv
from ci.scheduler import make_plan

# the GPU check's cases (ci/gpu_check.py): a tiny model and two proxies of 32 and 20 GiB
CHECK = [Case("tiny", 1, 60.0, gpu_memory_gib=4.0), Case("qwen", 1, 200.0, gpu_memory_gib=32.0),
         Case("wan", 1, 150.0, gpu_memory_gib=20.0)]


def starts(cases, spec):
    shared = on_shares(cases, spec)
    plan = make_plan([c.job for c in shared], range(spec.shares), 1, iterations=50)
    return {slot.name: slot.start for slot in plan.slots}


def test_a_case_takes_the_shares_that_hold_its_memory_and_whole_devices_without_a_figure():
    spec = ShareSpec(100, 139.0)
    assert [spec.shares_for(c) for c in CHECK] == [3, 24, 15]  # ceil(GiB / 1.39)
    assert spec.shares_for(Case("whole", 2, 10.0)) == 200
    assert spec.shares_for(Case("cpu", 0, 10.0)) == 0
    # a figure that is exactly a whole number of shares does not round up
    assert ShareSpec(4, 40.0).shares_for(Case("ten", 1, 1.0, gpu_memory_gib=10.0)) == 1


def test_cases_whose_memory_fits_together_start_together_on_one_gpu():
    assert set(starts(CHECK, ShareSpec(100, 139.0)).values()) == {0.0}


def test_cases_that_do_not_fit_together_wait_for_the_memory():
    # on a 40 GiB device the 32 GiB proxy cannot run beside the 20 GiB one
    plan = starts(CHECK, ShareSpec(4, 40.0))
    assert plan["qwen"] != plan["wan"]
    assert plan["tiny"] == 0.0 or plan["tiny"] == plan["wan"]
    assert max(plan.values()) > 0.0


def test_a_case_without_a_memory_figure_has_the_device_to_itself():
    cases = CHECK[:2] + [Case("unknown", 1, 100.0)]
    plan = starts(cases, ShareSpec(100, 139.0))
    ends = {c.name: plan[c.name] + c.est_time for c in cases}
    assert plan["tiny"] == plan["qwen"]
    for other in ("tiny", "qwen"):
        assert ends["unknown"] <= plan[other] or ends[other] <= plan["unknown"]


def test_a_memory_figure_is_refused_on_a_multi_gpu_case_and_above_the_device():
    with pytest.raises(ValueError, match="one-GPU cases"):
        ShareSpec(100, 139.0).shares_for(Case("wide", 2, 1.0, gpu_memory_gib=4.0))
    with pytest.raises(ValueError, match="needs 200 GiB, a GPU has 139 GiB"):
        ShareSpec(100, 139.0).shares_for(Case("big", 1, 1.0, gpu_memory_gib=200.0))


def test_ray_is_asked_for_a_fraction_of_one_device_or_whole_devices():
    assert ray_gpu_request(24, 100) == 0.24
    assert ray_gpu_request(200, 100) == 2
    assert ray_gpu_request(1, 1) == 1
    with pytest.raises(ValueError, match="span devices"):
        ray_gpu_request(150, 100)


def test_shares_of_one_device_name_it_once_for_cuda():
    labels = share_labels(["3"], 4)
    assert labels == ["3"] * 4 and devices_of(labels) == "3"
    assert devices_of(["0", "1", "0"]) == "0,1"


def test_a_case_on_a_share_leases_its_gpu_as_shared(tmp_path):
    case = Case("qwen", 24, 1.0, nodeid="t.py::q")
    assert "--miles-gpu-shared" in case_argv(case, RunSettings(tmp_path, tmp_path, ["0"], gpu_shared=True))
    assert "--miles-gpu-shared" not in case_argv(case, RunSettings(tmp_path, tmp_path, ["0"]))


HOLD = ("import json, os, sys, time; t = time.time(); time.sleep(3); "
        "open(sys.argv[1], 'w').write(json.dumps({'start': t, 'end': time.time(), "
        "'cuda': os.environ['CUDA_VISIBLE_DEVICES']}))")


def test_the_runner_runs_the_cases_at_once_on_the_one_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    entries = [{"name": c.name, "gpus": 1, "est_time": 2, "gpu_memory_gib": c.gpu_memory_gib,
                "command": ["{python}", "-c", HOLD, str(tmp_path / f"{c.name}.json")]} for c in CHECK]
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps(entries))
    code = run_suite.main(["--suite-json", str(suite), "--gpu-shares", "100", "--gpu-memory-gib", "139",
                           "--out", str(tmp_path / "out"), "--search-iterations", "20"])
    assert code == 0
    assert "GPUs 0 in 100 shares" in (tmp_path / "out" / "summary.md").read_text()
    runs = [json.loads((tmp_path / f"{c.name}.json").read_text()) for c in CHECK]
    assert {r["cuda"] for r in runs} == {"0"}
    # every case started before any ended: all three held the device at once
    assert max(r["start"] for r in runs) < min(r["end"] for r in runs)


def test_shares_without_the_devices_memory_or_on_several_gpus_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(run_suite, "nvml_gpu_memory_gib", lambda: None)
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps([{"name": "a", "gpus": 1, "est_time": 1, "gpu_memory_gib": 2}]))
    assert run_suite.main(["--suite-json", str(suite), "--gpu-shares", "10", "--gpus", "1", "--plan"]) == 2
    assert "give --gpu-memory-gib" in capsys.readouterr().err
    assert run_suite.main(["--suite-json", str(suite), "--gpu-shares", "10", "--gpu-memory-gib", "80",
                           "--gpus", "2", "--plan"]) == 2
    assert "--gpu-shares splits one GPU" in capsys.readouterr().err
    assert run_suite.main(["--suite-json", str(suite), "--gpu-memory-gib", "80", "--gpus", "1", "--plan"]) == 2
    assert "give --gpu-shares K too" in capsys.readouterr().err
