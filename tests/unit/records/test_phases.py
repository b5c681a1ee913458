import json
import os

from miles.records import phases


def test_marks_go_to_the_file_the_environment_names_and_nowhere_without_it(tmp_path, monkeypatch):
    monkeypatch.delenv(phases.PHASES_ENV, raising=False)
    phases.mark("nowhere")  # no file, no error
    path = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.PHASES_ENV, str(path))
    phases.mark("loop_start", rollout=0)
    phases.mark("recipe_process_start", t=12.5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["phase"] == "loop_start" and rows[0]["rollout"] == 0 and rows[0]["pid"] == os.getpid()
    assert rows[1]["t"] == 12.5  # an explicit time (a process start) wins
    assert [m["phase"] for m in phases.read_marks(path)] == ["recipe_process_start", "loop_start"]


def test_breakdown_measures_each_phase_and_each_actor_and_drops_what_is_missing():
    marks = [
        {"phase": "ray_head_start", "t": 10.0}, {"phase": "ray_head_ready", "t": 16.0},
        {"phase": "job_submit", "t": 17.0}, {"phase": "driver_process_start", "t": 20.0},
        {"phase": "actor_init", "t": 30.0, "pid": 7, "role": "rollout engine", "process_started": 25.0},
        {"phase": "actor_ready", "t": 33.0, "pid": 7, "role": "rollout engine"},
        {"phase": "loop_start", "t": 34.0}, {"phase": "loop_end", "t": 40.0},
    ]
    rows = dict(phases.breakdown(marks))
    assert rows["Ray head start"] == 6.0
    assert rows["job submission until the driver runs"] == 3.0
    assert rows["training loop"] == 6.0
    assert rows["  rollout engine: worker process start and module imports"] == 5.0
    assert rows["  rollout engine: model load and set-up"] == 3.0
    assert rows["total (first mark to last)"] == 30.0
    assert "teardown (cluster ended)" not in rows  # no job_end / teardown_end marks
