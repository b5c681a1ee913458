"""An fsdp checkpoint (2 ranks' DCP shards) exports to the same bytes as the data-parallel
checkpoint of the same weights: the reader gathers whole tensors from the shards, and the
written files depend only on names, dtypes and values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from export_runs import export, fsdp_rank, make_run, train_argv, write_run_records
from miles.utils.ports import free_ports


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "README.md"}  # the card names the checkpoint's own path


@pytest.fixture(scope="module")
def dp_and_fsdp_runs(tmp_path_factory, tiny_checkpoint):
    base = tiny_checkpoint("sd3")
    root = tmp_path_factory.mktemp("runs")
    dp, _ = make_run(root / "dp", base, "sd3", lora=False, ema=True)
    sharded = root / "fsdp"
    sharded.mkdir()
    write_run_records(sharded, train_argv(base, "sd3", sharded, lora=False, ema=True, backend="fsdp"), 2)
    mp.start_processes(_rank, args=(free_ports(1)[0], str(base), str(sharded)), nprocs=2, join=True,
                       start_method="spawn")
    return dp, sharded


def _rank(rank_id, port, base, run_dir):
    fsdp_rank(rank_id, port, base, run_dir, lora=False)


@pytest.mark.parametrize("weights", [[], ["--ema"]], ids=["trained", "ema"])
def test_fsdp_shards_from_two_ranks_export_to_the_bytes_of_the_dp_checkpoint(weights, dp_and_fsdp_runs, tmp_path):
    dp, sharded = dp_and_fsdp_runs
    assert (sharded / "checkpoints" / "rollout_000002" / "__1_0.distcp").is_file()  # really two ranks' shards
    for run in (dp, sharded):
        assert export(run, "--out", tmp_path / run.name, "--max-shard-size", "300KB", *weights) == 0
    ours, theirs = files_of(tmp_path / "dp"), files_of(tmp_path / "fsdp")
    assert sum(name.endswith(".safetensors") for name in ours) > 1  # several shards, each gathered on its own
    assert ours == theirs


def test_the_ema_export_differs_from_the_trained_one(dp_and_fsdp_runs, tmp_path):
    dp, _ = dp_and_fsdp_runs
    assert export(dp, "--out", tmp_path / "trained") == 0
    assert export(dp, "--out", tmp_path / "ema", "--ema") == 0
    assert files_of(tmp_path / "trained").keys() == files_of(tmp_path / "ema").keys()
    assert files_of(tmp_path / "trained") != files_of(tmp_path / "ema")
