"""Offloaded storages share one host arena of exactly their size, reused by every later offload;
torch's pinned allocator would have rounded each up to a power of two (what `rounded_bytes` says)."""

from __future__ import annotations

import torch

from miles.models.offload import ALIGNMENT, StorageOffload, resident_bytes


def _tensors():
    g = torch.Generator().manual_seed(0)
    # sizes just over a power of two, where the rounding costs most
    return [torch.randn(n, generator=g) for n in (257, 1025, 70_000)] + [torch.arange(3)]


def test_an_offload_holds_one_exact_arena_reused_by_the_next_and_restores_every_byte():
    tensors = _tensors()
    before = [t.clone() for t in tensors]
    part = StorageOffload("test part")
    part.offload(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors]
    assert resident_bytes(tensors) == 0 and part.host_bytes == sum(sizes)
    assert part.arena.nbytes == sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes) < sum(sizes) + len(sizes) * ALIGNMENT
    arena = part.arena.buffer
    part.reload()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    part.offload(tensors)  # the same storages again: the same arena, nothing new
    assert part.arena.buffer is arena
    part.reload()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_a_part_that_grows_gets_a_new_exact_arena_and_the_rounding_is_what_torch_would_pin():
    tensors = _tensors()
    part = StorageOffload("test part")
    part.offload(tensors[:2])
    part.reload()
    part.offload(tensors)  # optimizer state made by the first step: the part grows
    assert part.arena.nbytes >= part.host_bytes == sum(t.numel() * t.element_size() for t in tensors)
    # 1028 -> 2048, 4100 -> 8192, 280000 -> 524288, 24 -> 32: what the power-of-two blocks would take
    assert part.rounded_bytes == 2048 + 8192 + 524288 + 32
    part.reload()
