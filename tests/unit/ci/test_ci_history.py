"""The speed and memory gate against a test's own history."""

import pytest

from ci.history import (Fingerprint, History, Measurement, Thresholds, fingerprint_from_run_json,
                        load_thresholds, measurement_from_result)

H100 = "NVIDIA H100 80GB HBM3"
OLD_ENV = Fingerprint(gpu_model=H100, torch="2.11.0+cu128", cuda="12.8", driver="570.86")
NEW_TORCH = Fingerprint(gpu_model=H100, torch="2.11.0+cu130", cuda="12.8", driver="570.86")
GiB = 2**30
LIMITS = Thresholds()


def run(throughput=100.0, peak=40 * GiB, env=OLD_ENV, outcome="passed", test="wan22_gpu"):
    return Measurement(test, outcome, throughput, peak, 600.0, env)


@pytest.fixture
def history(tmp_path):
    db = History(tmp_path / "history.sqlite")
    yield db
    db.close()


def with_nights(history, nights=5, **kwargs):
    for night in range(nights):
        assert history.gate(run(throughput=100.0 + night % 2, **kwargs), LIMITS).ok
    return history


def test_cold_start_passes_with_no_history(history):
    verdict = history.gate(run(), LIMITS)
    assert verdict.ok and verdict.status == "no history"
    assert "no history" in verdict.describe()


def test_throughput_drop_of_30_percent_fails(history):
    with_nights(history)
    verdict = history.gate(run(throughput=70.0), LIMITS)
    assert not verdict.ok
    assert "throughput 70 vs 100 (median of 5): -30.0%, allowed -10%" in verdict.describe()


def test_same_drop_with_a_new_torch_fails_and_names_the_change(history):
    with_nights(history)
    verdict = history.gate(run(throughput=70.0, env=NEW_TORCH), LIMITS)
    assert not verdict.ok
    assert "torch 2.11.0+cu128 -> 2.11.0+cu130" in verdict.describe()


def test_new_torch_without_regression_passes_but_says_what_changed(history):
    with_nights(history)
    verdict = history.gate(run(env=NEW_TORCH), LIMITS)
    assert verdict.ok
    assert verdict.env_changes == ["torch 2.11.0+cu128 -> 2.11.0+cu130"]


def test_small_noise_passes(history):
    with_nights(history)
    assert history.gate(run(throughput=95.0, peak=41 * GiB), LIMITS).status == "pass"


def test_peak_memory_rise_beyond_threshold_fails(history):
    with_nights(history)
    verdict = history.gate(run(peak=44 * GiB), LIMITS)
    assert not verdict.ok
    assert "peak memory 45056 MiB vs 40960 MiB" in verdict.describe()


def test_history_of_another_gpu_model_is_not_compared(history):
    with_nights(history)
    other = Fingerprint(gpu_model="NVIDIA A100-SXM4-80GB", torch="2.11.0+cu128")
    verdict = history.gate(run(throughput=30.0, env=other), LIMITS)
    assert verdict.ok and "no history on NVIDIA A100-SXM4-80GB" in verdict.describe()


def test_a_regression_does_not_become_the_baseline_by_repeating(history):
    with_nights(history)
    for _ in range(6):
        assert not history.gate(run(throughput=70.0), LIMITS).ok


def test_failed_runs_are_not_a_baseline(history):
    history.gate(run(throughput=10.0, outcome="failed"), LIMITS)
    verdict = history.gate(run(throughput=100.0), LIMITS)
    assert verdict.status == "no history"


def test_per_test_threshold_overrides_default(tmp_path, history):
    path = tmp_path / "thresholds.yaml"
    path.write_text("defaults: {throughput_drop: 0.1}\n"
                    "tests:\n  wan22_gpu: {throughput_drop: 0.4, reason: shared disk}\n")
    registry = load_thresholds(path)
    with_nights(history)
    assert history.gate(run(throughput=70.0), registry.for_test("wan22_gpu")).ok
    assert registry.for_test("other").throughput_drop == 0.1


def test_threshold_override_without_reason_is_refused(tmp_path):
    path = tmp_path / "thresholds.yaml"
    path.write_text("tests:\n  wan22_gpu: {throughput_drop: 0.4}\n")
    with pytest.raises(ValueError, match="needs a reason"):
        load_thresholds(path)


def test_fingerprint_and_measurement_come_from_the_harness_result():
    result = {"name": "x", "outcome": "passed", "wall_time": 12.0, "throughput": 3.5,
              "peak_memory": 1e9,
              "run_json": {"versions": {"torch": "2.13.0", "cuda": "13.0", "driver": "580.1",
                                        "python": "3.11.7"},
                           "gpu_names": [H100, H100], "git_commit": "abc"}}
    m = measurement_from_result(result)
    assert m.fingerprint.gpu_model == H100
    assert (m.fingerprint.torch, m.fingerprint.cuda, m.fingerprint.driver) == ("2.13.0", "13.0", "580.1")
    assert m.throughput == 3.5 and m.peak_memory == 1e9
    assert fingerprint_from_run_json(None).gpu_model == "cpu"


def test_runs_are_stored_with_their_environment(history):
    history.gate(run(env=NEW_TORCH), LIMITS)
    (row,) = history.runs("wan22_gpu")
    assert row["torch"] == "2.11.0+cu130" and row["gpu_model"] == H100 and row["wall_time"] == 600.0


def test_harness_throughput_summary_is_read_as_its_mean():
    result = {"name": "x", "outcome": "passed", "throughput": {"last": 9.0, "mean": 8.0},
              "peak_memory": None, "run_json": None}
    assert measurement_from_result(result).throughput == 8.0
    assert measurement_from_result({**result, "throughput": None}).throughput is None


def test_forgetting_a_test_starts_its_history_over(tmp_path, capsys):
    from ci.history import main

    db = tmp_path / "h.sqlite"
    history = History(db)
    with_nights(history)
    history.gate(run(test="other"), LIMITS)
    history.close()
    assert main(["forget", "--db", str(db), "--test", "wan22_gpu"]) == 0
    assert "deleted 5 runs of wan22_gpu" in capsys.readouterr().out
    main(["show", "--db", str(db)])
    shown = capsys.readouterr().out
    assert "other" in shown and "wan22_gpu" not in shown
    history = History(db)
    assert history.gate(run(throughput=10.0), LIMITS).status == "no history"
    history.close()
