import json
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from miles.records.run_logging import MetricsLogger, Progress, plot_curves, read_metrics, save_image_grid, write_run_json

ROW = {"rollout/reward/raw_mean": 0.5, "train/loss": torch.tensor(0.25), "perf/train_time": 1.5,
       "train/model_output_max_abs_diff": 0.0}


def test_metrics_jsonl_holds_one_object_per_rollout_with_perf_alongside(tmp_path):
    logger = MetricsLogger(tmp_path, deterministic=False)
    logger.log(0, ROW)
    logger.log(1, ROW)
    rows = read_metrics(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert rows[0]["train/loss"] == 0.25 and rows[0]["perf/train_time"] == 1.5
    perf = [json.loads(line) for line in (tmp_path / "perf.jsonl").read_text().splitlines()]
    assert perf[1] == {"rollout_id": 1, "perf/train_time": 1.5}


def test_deterministic_mode_keeps_wall_clock_keys_out_of_metrics_jsonl(tmp_path):
    MetricsLogger(tmp_path, deterministic=True).log(0, ROW)
    row = read_metrics(tmp_path)[0]
    assert not [k for k in row if k.startswith("perf/")]
    assert "perf/train_time" in (tmp_path / "perf.jsonl").read_text()


def test_a_resumed_logger_drops_rows_from_the_start_id_on(tmp_path):
    logger = MetricsLogger(tmp_path, deterministic=False)
    for i in range(4):
        logger.log(i, ROW)
    MetricsLogger(tmp_path, deterministic=False, start_rollout_id=2).log(2, ROW)
    assert [r["rollout_id"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_run_json_records_provenance_and_resume(tmp_path):
    record = write_run_json(tmp_path, ["--lr", "1"], resumed=True, start_rollout_id=4)
    on_disk = json.loads((tmp_path / "run.json").read_text())
    assert on_disk == record
    assert on_disk["resumed"] is True and on_disk["start_rollout_id"] == 4
    assert on_disk["versions"]["torch"] == torch.__version__ and on_disk["argv"] == ["--lr", "1"]
    assert set(on_disk) >= {"git_commit", "gpu_names", "hostname", "started_at"}


def test_run_json_names_the_hub_commit_of_a_cached_checkpoint_it_was_given(tmp_path):
    repo = tmp_path / "hub" / "models--org--model"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    record = write_run_json(tmp_path / "run", ["--hf-checkpoint", str(snapshot), "--lr", "1"], resumed=False,
                            start_rollout_id=0)
    assert record["hub_revisions"] == {"--hf-checkpoint": {"repo_id": "org/model", "repo_type": "model",
                                                           "commit": "a" * 40, "refs": ["main"]}}
    assert write_run_json(tmp_path / "other", ["--lr", "1"], resumed=False, start_rollout_id=0)["hub_revisions"] == {}


def test_progress_line_names_reward_loss_parity_time_and_eta():
    line = Progress(0, 10).line(0, {"rollout/reward/raw_mean": 0.5, "train/loss": 0.25,
                                    "train/model_output_max_abs_diff": 0.0}, 2.0)
    for part in ("rollout 1/10", "reward=0.5", "loss=0.25", "parity_diff=0", "time=2.0s", "eta="):
        assert part in line


def test_curves_and_image_grid_are_written(tmp_path):
    logger = MetricsLogger(tmp_path, deterministic=False)
    logger.log(0, ROW)
    logger.log(1, {**ROW, "rollout/reward/raw_mean": 0.7})
    assert plot_curves(tmp_path).stat().st_size > 0
    grid = save_image_grid([torch.rand(3, 8, 8) for _ in range(5)], tmp_path / "grid.png")
    from PIL import Image

    assert Image.open(grid).size == (24, 16)  # 3 columns x 2 rows


def test_curves_have_labelled_axes_and_the_parity_caption(tmp_path):
    from miles.records.run_logging import CURVE_PANELS, PARITY_CAPTION, curves_figure

    rows = [{"rollout_id": i, "rollout/reward/raw_mean": 0.1 * i, "train/loss": 0.5, "train/grad_norm": 1.0,
             "train/model_output_max_abs_diff": 0.0} for i in range(3)]
    fig = curves_figure(rows)
    axes = fig.axes
    assert [ax.get_xlabel() for ax in axes] == ["rollout"] * len(CURVE_PANELS)
    for ax, (key, _, _) in zip(axes, CURVE_PANELS):
        assert key in ax.get_ylabel()  # each y axis names its metric
        assert len(ax.lines[0].get_xdata()) == 3
    assert PARITY_CAPTION in [t.get_text() for t in fig.texts]
    assert "must be exactly 0" in PARITY_CAPTION and "|train forward - rollout forward|" in PARITY_CAPTION


def test_last_rollout_grid_captions_each_sample_with_its_prompt_and_reward(tmp_path):
    from PIL import Image

    from miles.records.run_logging import image_grid_figure, save_image_grid

    long_prompt = "a watercolor painting of a lighthouse on a cliff at dusk with seagulls and waves"
    captions = [(long_prompt, 0.8125), ("a red car", 0.25), ("a blue bird", -1.5)]
    images = [torch.rand(3, 8, 8), torch.rand(2, 3, 8, 8), torch.rand(3, 8, 8)]  # a video shows its first frame
    titles = [ax.get_title() for ax in image_grid_figure(images, captions).axes if ax.get_title()]
    assert len(titles) == 3
    assert titles[1] == "a red car\nreward 0.25" and titles[2].endswith("reward -1.5")
    first_line = titles[0].splitlines()[0]
    assert first_line.startswith("a watercolor painting") and first_line.endswith("\u2026") and len(first_line) <= 40
    assert titles[0].endswith("reward 0.8125")
    out = save_image_grid(images, tmp_path / "last_rollout.png", captions=captions)
    assert Image.open(out).size[0] > 0


WANDB_SCRIPT = """
import sys
from types import SimpleNamespace
from miles.records.run_logging import MetricsLogger, init_wandb
args = SimpleNamespace(use_wandb=True, wandb_project="t", wandb_group=None, wandb_run_name="r",
                       wandb_mode="offline", wandb_dir=sys.argv[1], run_dir=sys.argv[1])
logger = MetricsLogger(sys.argv[1], deterministic=False, wandb_run=init_wandb(args))
logger.log(0, {"train/loss": 0.5})
logger.close()
"""


def test_wandb_offline_mirrors_the_metrics(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    subprocess.run([sys.executable, "-c", WANDB_SCRIPT, str(tmp_path)], env=env, check=True, timeout=120)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    # the offline record is wandb's binary log; the logged key must be in it
    assert b"train/loss" in next(runs[0].glob("*.wandb")).read_bytes()


class _WandbRun:
    """Stands in for a wandb run: what `log` was given, by step."""

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, data, step):
        self.logged.append((step, data))


def test_wandb_log_num_images_logs_that_many_samples_every_interval_rollouts(tmp_path):
    import torch

    run = _WandbRun()
    logger = MetricsLogger(tmp_path, deterministic=False, wandb_run=run)
    images = [torch.full((3, 8, 8), i / 10) for i in range(5)]
    captions = [(f"prompt {i}", 0.1 * i) for i in range(5)]
    counts = [logger.log_images(r, images, captions, count=3, interval=2) for r in range(4)]
    assert counts == [3, 0, 3, 0] and [step for step, _ in run.logged] == [0, 2]
    shown = run.logged[0][1]["rollout/samples"]
    assert len(shown) == 3 and "prompt 2" in shown[2]._caption
    assert logger.log_images(0, images, captions, count=0, interval=1) == 0  # the default: none
    assert MetricsLogger(tmp_path / "w", deterministic=False).log_images(0, images, None, count=3, interval=1) == 0
