"""A sharded train rank is built on meta and reads only its own rows: no rank ever holds the whole
weights, and what it holds is bit for bit what the old order (load whole, then shard) gave it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtype_helpers import tiny_assets
from miles.backends import fsdp
from miles.backends.lora import LoraSpec, attach_lora, is_lora_param
from miles.backends.sharded_load import attach_lora_on_meta, frozen_base_to, materialize_from_checkpoint
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


def _sharded_meta_transformer(checkpoint, lora: LoraSpec | None, base_dtype: torch.dtype | None = None):
    model = load_model(checkpoint, dtype=torch.float32, skip=TEXT_PARTS, empty={"transformer": torch.float32})
    module = model.transformers["transformer"]
    values = attach_lora_on_meta(module, lora) if lora else module.requires_grad_(True) and None
    if base_dtype is not None:
        frozen_base_to(module, base_dtype)
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


def test_a_lora_base_cast_on_meta_holds_the_checkpoints_rows_rounded_and_the_adapters_in_float32(rank_one_of_four):
    checkpoint, _ = tiny_assets()
    torch.manual_seed(7)
    fp32_module, _ = _sharded_meta_transformer(checkpoint, LORA)
    torch.manual_seed(7)
    module, read = _sharded_meta_transformer(checkpoint, LORA, torch.bfloat16)
    whole = dict(load_model(checkpoint, dtype=torch.float32).transformers["transformer"].named_parameters())
    fp32_params = dict(fp32_module.named_parameters())
    for name, p in module.named_parameters():
        local = p.to_local()
        if is_lora_param(name):
            assert p.requires_grad and local.dtype == torch.float32, name
            assert torch.equal(local, fp32_params[name].to_local()), name
        else:  # what FSDP's all-gather made of the float32 master: the same round-to-nearest cast
            assert local.dtype == torch.bfloat16 and not p.requires_grad, name
            expected = whole[name.replace(".base_layer.", ".")].detach()[_rows(p)]
            assert torch.equal(local, expected.to(torch.bfloat16)), name
    assert read > 0


def test_text_encoders_skipped_by_the_loader_hold_no_bytes():
    checkpoint, _ = tiny_assets()
    model = load_model(checkpoint, dtype=torch.float32, skip=TEXT_PARTS)
    assert [n for n, p in model.parts.items() if n.startswith(TEXT_PARTS)] and model.text_encoders == {}
    assert all(p is None for n, p in model.parts.items() if n.startswith(TEXT_PARTS))
    assert model.transformers["transformer"] is not None and model.vae is not None


class LiveBytes:
    """Bytes of host tensor storage alive, and their peak, counted at every op that makes a tensor
    (a TorchDispatchMode; a storage is counted once and uncounted when freed)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker._count(t)
                return out

        self.mode, self.live, self.peak, self._sizes = Mode(), 0, 0, {}

    def _count(self, tensor: torch.Tensor) -> None:
        import weakref

        try:  # a wrapper subclass (DTensor) has no storage of its own; its local tensor is counted
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
        except RuntimeError:
            return
        if key and key not in self._sizes:
            self._sizes[key] = storage.nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.live -= self._sizes.pop(key, 0)


def _old_load_models(self, param_dtype, compute_dtype):
    """The load order before issue 25: the whole pipeline in the param dtype, text encoders
    included, dropped only afterwards; the trained transformer whole until sharded."""
    args = self.args
    self.meta_built = False
    self.model = self.fmodel = load_model(args.hf_checkpoint, family=args.diffusion_model_family,
                                          device=self.device, dtype=param_dtype)
    for name in [n for n in self.model.parts if n.startswith(TEXT_PARTS)]:
        self.model.parts[name] = None
    self.model.text_encoders = {}


def _setup_bytes(run_dir, monkeypatch=None):
    from fsdp_helpers import fsdp_args
    from miles.backends.actor import TrainRank

    args, plan = fsdp_args(run_dir, "--rollout-batch-size 4 --num-steps-per-rollout 1 --colocate", RANKS)
    if monkeypatch is not None:
        monkeypatch.setattr(TrainRank, "_load_models", _old_load_models)
    tracker = LiveBytes()
    with tracker.mode:
        rank = TrainRank(args, plan, 0, RANKS)
        rank.setup()
    return tracker.peak, tracker.live, rank


def test_setup_peaks_at_its_steady_state_where_the_old_order_held_the_whole_pipeline(tmp_path, monkeypatch,
                                                                                         rank_one_of_four):
    peak, steady, rank = _setup_bytes(tmp_path / "new")
    old_peak, old_steady, _ = _setup_bytes(tmp_path / "old", monkeypatch)
    checkpoint, _ = tiny_assets()
    whole = load_model(checkpoint, dtype=torch.float32)
    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    transformer = whole.transformers["transformer"]
    params, buffers = nbytes(transformer.parameters()), nbytes(transformer.buffers())
    encoders = sum(nbytes(m.parameters()) for n, m in whole.parts.items() if n.startswith("text_encoder") and m)
    print(f"setup peak {peak} B (steady {steady}), old order {old_peak} B (steady {old_steady})")
    assert old_steady == steady  # the same rank in the end
    # new: beyond the steady state at most one stored buffer read beside the one computed at
    # build time, and one weight's rows in flight
    assert peak - steady <= buffers + max(p.numel() * p.element_size() for p in transformer.parameters())
    # old: the whole float32 transformer (3/4 of it not this rank's) and the text encoders at once
    assert old_peak - steady >= params * (RANKS - 1) / RANKS + encoders
