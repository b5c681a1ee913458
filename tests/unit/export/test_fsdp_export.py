"""An fsdp checkpoint (2 ranks' DCP shards) exports to the same bytes as the data-parallel
checkpoint of the same weights: the reader gathers whole tensors from the shards, and the
written files depend only on names, dtypes and values."""

from __future__ import annotations

from pathlib import Path

import pytest

import torch.multiprocessing as mp

from export_runs import export, fsdp_ranks, make_run, train_argv, write_run_records
from miles.export.destination import MARKER
from miles.utils.ports import free_ports


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in ("README.md", MARKER)}  # both name the checkpoint's own path


@pytest.mark.slow  # the export of a data-parallel checkpoint and the sharded save/load stay in the README's command
def test_fsdp_shards_from_two_ranks_export_to_the_bytes_of_the_dp_checkpoint(tmp_path, tiny_checkpoint):
    """One test (one spawn of 2 ranks): a full fine-tune (in shards of 300KB) and a LoRA, their
    trained weights and their EMA shadows, each exported from both checkpoints."""
    base = tiny_checkpoint("sd3")
    kinds = {"full": False, "lora": True}
    for kind, lora in kinds.items():
        make_run(tmp_path / "dp" / kind, base, "sd3", lora=lora, ema=True)
        sharded = tmp_path / "fsdp" / kind
        sharded.mkdir(parents=True)
        write_run_records(sharded, train_argv(base, "sd3", sharded, lora=lora, ema=True, backend="fsdp"), 2)
    runs = [(str(tmp_path / "fsdp" / kind), lora) for kind, lora in kinds.items()]
    mp.start_processes(fsdp_ranks, args=(free_ports(1)[0], str(base), runs), nprocs=2, join=True,
                       start_method="spawn")
    exported = {}
    for kind in kinds:
        assert (tmp_path / "fsdp" / kind / "checkpoints" / "rollout_000002" / "__1_0.distcp").is_file()  # 2 ranks
        for weights in ("trained", "ema"):
            for backend in ("dp", "fsdp"):
                out = tmp_path / "out" / kind / weights / backend
                flags = ["--max-shard-size", "300KB"] + (["--ema"] if weights == "ema" else [])
                assert export(tmp_path / backend / kind, "--out", out, *flags) == 0
                exported[kind, weights, backend] = files_of(out)
            assert exported[kind, weights, "dp"] == exported[kind, weights, "fsdp"]
        assert exported[kind, "trained", "dp"] != exported[kind, "ema", "dp"]  # --ema exports the shadow
    assert sum(name.endswith(".safetensors") for name in exported["full", "trained", "dp"]) > 1  # several shards
