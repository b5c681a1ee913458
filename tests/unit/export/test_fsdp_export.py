"""An fsdp checkpoint (2 ranks' DCP shards) exports to the same bytes as the data-parallel
checkpoint of the same weights: the reader gathers whole tensors from the shards, and the
written files depend only on names, dtypes and values."""

from __future__ import annotations

from pathlib import Path

import torch.multiprocessing as mp

from export_runs import export, fsdp_rank, make_run, train_argv, write_run_records
from miles.utils.ports import free_ports


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "README.md"}  # the card names the checkpoint's own path


def test_fsdp_shards_from_two_ranks_export_to_the_bytes_of_the_dp_checkpoint(tmp_path, tiny_checkpoint):
    """One test (one spawn of 2 ranks): the trained weights and the EMA shadow, each exported from
    both checkpoints in shards of 300KB."""
    base = tiny_checkpoint("sd3")
    dp, _ = make_run(tmp_path / "dp", base, "sd3", lora=False, ema=True)
    sharded = tmp_path / "fsdp"
    sharded.mkdir()
    write_run_records(sharded, train_argv(base, "sd3", sharded, lora=False, ema=True, backend="fsdp"), 2)
    mp.start_processes(_rank, args=(free_ports(1)[0], str(base), str(sharded)), nprocs=2, join=True,
                       start_method="spawn")
    assert (sharded / "checkpoints" / "rollout_000002" / "__1_0.distcp").is_file()  # really two ranks' shards
    exported = {}
    for weights in ("trained", "ema"):
        for run in (dp, sharded):
            out = tmp_path / "out" / weights / run.name
            assert export(run, "--out", out, "--max-shard-size", "300KB", *(["--ema"] if weights == "ema" else [])) == 0
            exported[weights, run.name] = files_of(out)
        assert sum(name.endswith(".safetensors") for name in exported[weights, "dp"]) > 1  # several shards
        assert exported[weights, "dp"] == exported[weights, "fsdp"]
    assert exported["trained", "dp"].keys() == exported["ema", "dp"].keys()
    assert exported["trained", "dp"] != exported["ema", "dp"]  # --ema exports the shadow, not the weights


def _rank(rank_id, port, base, run_dir):
    fsdp_rank(rank_id, port, base, run_dir, lora=False)
