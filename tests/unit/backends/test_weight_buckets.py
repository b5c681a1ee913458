"""Bucketed weight sync, in process: the plan, the packing and unpacking, the staging bound.

The transfer between sender and receiver is a list here (what the sender broadcasts, the receiver
is filled with); tests/unit/backends/test_sync_group.py runs the same code over gloo.
"""

from __future__ import annotations

import pytest
import torch

from miles.backends.weight_buckets import (
    BucketPlan, Staging, engine_targets, plan_buckets, receive_buckets, send_buckets,
)
from miles.backends.weight_sync import apply_weight_update, collect_weight_updates, synced_tensors
from weight_sync_models import LoraLike, bit_equal, perturbed, state


def sync_in_process(trainer, engine, buffer_bytes: int, lora_only: bool = False,
                    engine_dtype: torch.dtype = torch.float32) -> tuple[BucketPlan, Staging, Staging]:
    tensors = synced_tensors({"transformer": trainer}, ["transformer"], lora_only)
    plan = plan_buckets(tensors, engine_dtype, buffer_bytes)
    wire: list[torch.Tensor] = []
    sent = send_buckets(plan, {(c, n): t for c, n, t in tensors}, lambda t: wire.append(t.clone()), torch.device("cpu"))
    received = receive_buckets(plan, engine_targets({"transformer": engine}, plan), lambda t: t.copy_(wire.pop(0)),
                               torch.device("cpu"))
    assert not wire, "the receiver took fewer buckets than were sent"
    return plan, sent, received


def object_store_sync(trainer, engine, lora_only: bool = False) -> None:
    (update,) = collect_weight_updates({"transformer": trainer}, ["transformer"], lora_only)
    apply_weight_update(engine, update.state_dict)


@pytest.mark.parametrize("buffer_bytes", [1, 200, 1024, 1 << 20])
def test_full_weights_arrive_bit_exact_at_any_buffer_size(buffer_bytes):
    trainer, engine = perturbed(LoraLike(), 1), LoraLike()
    sync_in_process(trainer, engine, buffer_bytes)
    assert bit_equal(state(engine), state(trainer))


def test_buckets_respect_the_buffer_size_and_a_bigger_tensor_travels_alone():
    tensors = synced_tensors({"transformer": LoraLike()}, ["transformer"], False)
    embed_bytes = 64 * 16 * 4
    plan = plan_buckets(tensors, torch.float32, 1024)
    for bucket in plan.buckets:
        assert bucket.nbytes <= 1024 or len(bucket.slots) == 1
        assert bucket.nbytes == sum(s.nbytes for s in bucket.slots)
        assert [s.offset for s in bucket.slots] == [sum(s.nbytes for s in bucket.slots[:i]) for i in range(len(bucket.slots))]
    (alone,) = [b for b in plan.buckets if plan.oversize(b)]
    assert [s.name for s in alone.slots] == ["embed.weight"] and alone.nbytes == embed_bytes
    assert plan.total_bytes == sum(t.numel() * 4 for _, _, t in tensors)
    # consecutive tensors share a bucket: fewer buckets than tensors
    assert len(plan.buckets) < len(tensors)


def test_order_is_named_parameters_order_grouped_by_dtype_first_met_first():
    model = LoraLike()
    model.blocks[1].norm.to(torch.float64)  # floating: travels in the engine's dtype like the rest
    model.blocks[0].register_parameter("steps", torch.nn.Parameter(torch.arange(3), requires_grad=False))
    tensors = synced_tensors({"transformer": model}, ["transformer"], False)
    plan = plan_buckets(tensors, torch.bfloat16, 256)
    names = [s.name for b in plan.buckets for s in b.slots]
    floating = [n for n, p in model.named_parameters() if p.dtype.is_floating_point]
    assert names == floating + ["blocks.0.steps"]  # the int64 group after the bfloat16 one
    assert [b.dtype for b in plan.buckets][-1] == "int64" and {b.dtype for b in plan.buckets[:-1]} == {"bfloat16"}


def test_a_float32_trainer_reaches_a_bfloat16_engine_with_the_object_store_paths_bits():
    trainer = perturbed(LoraLike(), 2)
    via_store, via_buckets = LoraLike().to(torch.bfloat16), LoraLike().to(torch.bfloat16)
    object_store_sync(trainer, via_store)
    plan, sent, _ = sync_in_process(trainer, via_buckets, 512, engine_dtype=torch.bfloat16)
    assert bit_equal(state(via_buckets), state(via_store))
    assert {b.dtype for b in plan.buckets} == {"bfloat16"}
    assert plan.total_bytes * 2 == sum(p.numel() * 4 for p in trainer.parameters())  # half the bytes on the wire


def test_lora_sync_carries_only_adapters_and_matches_the_object_store_path():
    trainer = perturbed(LoraLike(lora_rank=2), 3)
    via_store, via_buckets = LoraLike(lora_rank=2), LoraLike(lora_rank=2)
    object_store_sync(trainer, via_store, lora_only=True)
    plan, _, _ = sync_in_process(trainer, via_buckets, 1 << 20, lora_only=True)
    names = [s.name for b in plan.buckets for s in b.slots]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(plan.buckets) == 1  # adapters are small: one broadcast
    assert bit_equal(state(via_buckets), state(via_store))
    assert not torch.equal(via_buckets.blocks[0].proj.weight, trainer.blocks[0].proj.weight)  # the base stayed


@pytest.mark.parametrize("buffer_bytes", [100, 1024, 4096])
def test_sender_and_receiver_never_stage_more_than_one_bucket(buffer_bytes):
    trainer, engine = perturbed(LoraLike(), 4), LoraLike()
    plan, sent, received = sync_in_process(trainer, engine, buffer_bytes)
    one_bucket = max(b.nbytes for b in plan.buckets)
    assert 0 < sent.peak <= one_bucket and 0 < received.peak <= one_bucket
    assert sent.peak <= buffer_bytes and received.peak <= buffer_bytes  # oversize tensors moved without staging


def test_an_oversize_tensor_in_another_dtype_stages_one_copy_of_itself_only():
    trainer = perturbed(LoraLike(), 5)
    engine = LoraLike().to(torch.bfloat16)
    plan, sent, received = sync_in_process(trainer, engine, 512, engine_dtype=torch.bfloat16)
    one_bucket = max(b.nbytes for b in plan.buckets)
    assert one_bucket == 64 * 16 * 2 and sent.peak <= plan.shared_buffer_bytes + one_bucket
    assert received.peak <= plan.shared_buffer_bytes  # bfloat16 on the wire lands straight in the engine


def test_an_engine_missing_a_tensor_or_shaped_otherwise_is_refused_before_anything_moves():
    plan = plan_buckets(synced_tensors({"transformer": LoraLike(lora_rank=2)}, ["transformer"], True), torch.float32, 64)
    with pytest.raises(KeyError, match="has no tensor"):
        engine_targets({"transformer": LoraLike()}, plan)
    with pytest.raises(ValueError, match="has shape"):
        engine_targets({"transformer": LoraLike(lora_rank=3)}, plan)
    with pytest.raises(KeyError, match="lacks"):
        engine_targets({"transformer_2": LoraLike(lora_rank=2)}, plan)


def test_a_buffer_of_no_bytes_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        plan_buckets([], torch.float32, 0)
