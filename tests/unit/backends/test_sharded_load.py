"""A sharded train rank is built on meta and reads only its own rows: no rank ever holds the whole
weights, and what it holds is bit for bit what the old order (load whole, then shard) gave it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtype_helpers import tiny_assets
from miles.backends import fsdp
from miles.backends.lora import LoraSpec, attach_lora, is_lora_param
from miles.backends.sharded_load import attach_lora_on_meta, materialize_from_checkpoint
from miles.models.loader import TEXT_PARTS, load_model

RANKS = 4
LORA = LoraSpec(rank=4, alpha=8, target_modules=("to_q", "to_k", "to_v"))


@pytest.fixture
def rank_one_of_four():
    """This process as rank 1 of a fake 4-rank group (collectives return at once, no peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=RANKS)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rows(tensor):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _sharded_meta_transformer(checkpoint, lora: LoraSpec | None):
    model = load_model(checkpoint, dtype=torch.float32, skip=TEXT_PARTS, empty={"transformer": torch.float32})
    module = model.transformers["transformer"]
    values = attach_lora_on_meta(module, lora) if lora else module.requires_grad_(True) and None
    fsdp.shard_model(model, ["transformer"], fsdp.device_mesh(torch.device("cpu"), RANKS), torch.float32,
                     torch.float32)
    read = materialize_from_checkpoint(module, checkpoint / "transformer", torch.device("cpu"), values)
    return module, read


def test_a_rank_of_four_reads_only_its_rows_and_they_equal_the_whole_checkpoints(rank_one_of_four):
    checkpoint, _ = tiny_assets()
    module, read = _sharded_meta_transformer(checkpoint, None)
    whole = load_model(checkpoint, dtype=torch.float32).transformers["transformer"]
    whole_params = dict(whole.named_parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in whole_params.values())
    buffer_bytes = sum(b.numel() * b.element_size() for b in whole.buffers())
    for name, p in module.named_parameters():
        assert torch.equal(p.to_local(), whole_params[name].detach()[_rows(p)]), name
    held = sum(p.to_local().numel() * p.element_size() for p in module.parameters())
    # torch.chunk rows: every tensor's share is at most one row over a quarter
    assert held <= param_bytes / RANKS + sum(p[0].numel() * 4 for p in whole_params.values())
    assert read <= held + buffer_bytes < param_bytes
    for name, b in module.named_buffers():
        assert torch.equal(b, dict(whole.named_buffers())[name]), name


def test_lora_on_a_meta_built_transformer_gets_the_values_and_rng_of_a_loaded_one(rank_one_of_four):
    checkpoint, _ = tiny_assets()
    torch.manual_seed(7)
    loaded = load_model(checkpoint, dtype=torch.float32).transformers["transformer"]
    attach_lora(loaded, LORA)
    rng_after_loaded = torch.get_rng_state()
    expected = {n: p.detach() for n, p in loaded.named_parameters() if is_lora_param(n)}

    torch.manual_seed(7)
    module, _ = _sharded_meta_transformer(checkpoint, LORA)
    assert torch.equal(torch.get_rng_state(), rng_after_loaded)
    got = {n: p for n, p in module.named_parameters() if is_lora_param(n)}
    assert sorted(got) == sorted(expected) and any(expected[n].abs().sum() > 0 for n in expected)
    for name, p in got.items():
        assert p.requires_grad and torch.equal(p.to_local(), expected[name][_rows(p)]), name


def test_text_encoders_skipped_by_the_loader_hold_no_bytes():
    checkpoint, _ = tiny_assets()
    model = load_model(checkpoint, dtype=torch.float32, skip=TEXT_PARTS)
    assert [n for n, p in model.parts.items() if n.startswith(TEXT_PARTS)] and model.text_encoders == {}
    assert all(p is None for n, p in model.parts.items() if n.startswith(TEXT_PARTS))
    assert model.transformers["transformer"] is not None and model.vae is not None
