"""LiveMemory: what the replay counts, where, and for how long."""

from __future__ import annotations

import torch

from miles.replay.memory import HOST, UNPLACED, LiveMemory

GPU = "train GPU"


def test_bytes_are_charged_to_the_running_role_and_freed_with_their_storage():
    memory = LiveMemory()
    with memory.mode, memory.at(GPU, "train rank"), memory.measuring("train") as phase:
        weight = torch.empty(1024, 256, dtype=torch.bfloat16, device="meta")
        scratch = weight * 2  # made from a device tensor: on the device
        assert memory.held(GPU, "train rank") == 2 * 1024 * 256 * 2
        del scratch
        assert memory.held(GPU, "train rank") == 1024 * 256 * 2
    assert phase.place_peak(GPU) == 2 * 1024 * 256 * 2


def test_a_copy_to_the_cpu_is_host_memory():
    memory = LiveMemory()
    with memory.mode, memory.at(GPU, "engine"):
        device = torch.empty(1000, dtype=torch.float32, device="meta")
        host = device.cpu()
        assert host.device.type == "meta"  # no bytes are ever made
        assert memory.held(HOST, "engine") == 4000 and memory.held(GPU, "engine") == 4000
        # a host tensor asked onto the device, cast on the way, is a device tensor
        back = host.to(torch.device("meta"), dtype=torch.bfloat16)
        assert memory.held(GPU, "engine") == 4000 + 2000
        del back


def test_what_the_real_run_builds_on_meta_is_charged_nowhere():
    memory = LiveMemory()
    with memory.mode, memory.at(UNPLACED, "train rank"):
        empty = torch.empty(4096, 4096, device="meta")
        view = empty.t().contiguous()
    assert memory.held(GPU) == memory.held(HOST) == 0
    assert view.shape == (4096, 4096)


def test_a_scalar_read_from_a_meta_tensor_is_zero():
    memory = LiveMemory()
    with memory.mode, memory.at(GPU, "train rank"):
        assert float(torch.empty(3, device="meta").sum()) == 0.0


def test_an_op_repeated_on_the_same_shapes_makes_what_torch_makes_and_is_charged_again():
    x = torch.empty(64, 32, dtype=torch.bfloat16, device="meta").t()  # a transposed input: its layout carries over
    weight = torch.empty(64, 16, dtype=torch.float32, device="meta")
    expected = [(t.shape, t.stride(), t.dtype) for t in (x * 2.0, torch.cat([x, x]), x.float() @ weight)]
    memory = LiveMemory()
    with memory.mode, memory.at(GPU, "train rank"):
        for _ in range(2):  # the second round is answered from what the first one made
            made = [x * 2.0, torch.cat([x, x]), x.float() @ weight]
            assert [(t.shape, t.stride(), t.dtype) for t in made] == expected
        assert memory.held(GPU, "train rank") == sum(t.numel() * t.element_size() for t in made)


def test_an_in_place_update_repeated_returns_its_tensor_unchanged():
    memory = LiveMemory()
    with memory.mode, memory.at(GPU, "train rank"):
        weight = torch.empty(8, 4, device="meta")
        for _ in range(2):
            assert weight.uniform_(-1, 1) is weight and weight.add_(weight) is weight
        assert weight.shape == (8, 4) and memory.held(GPU, "train rank") == 8 * 4 * 4


def test_what_a_fake_tensor_mode_makes_is_charged_nowhere():
    # DTensor's sharding propagation builds an op's inputs at their global shapes under a
    # FakeTensorMode, on a miss of its per-process cache only: charged, they made a replay's
    # figures depend on what ran before it in the process
    from torch._subclasses.fake_tensor import FakeTensorMode

    memory = LiveMemory()
    with memory.mode, memory.at(GPU, "train rank"):
        with FakeTensorMode():
            fake = torch.empty_strided((4096, 4096), (4096, 1), dtype=torch.float32, device="cpu")
            assert (fake * 2).shape == (4096, 4096)
        assert memory.held(GPU) == memory.held(HOST) == 0
        real = torch.empty(1024, dtype=torch.float32, device="meta")
        assert memory.held(GPU, "train rank") == 4096  # the mode still counts once the fake one is gone
        del real


def test_each_segment_of_a_phase_has_its_own_peak():
    memory = LiveMemory()
    with memory.mode, memory.at(GPU, "train rank"), memory.measuring("setup") as phase:
        transient = torch.empty(1000, dtype=torch.uint8, device="meta")
        del transient
        memory.mark("builds transformer")
        kept = torch.empty(600, dtype=torch.uint8, device="meta")
    assert [s.label for s in phase.segments] == ["setup", "builds transformer"]
    assert [s.peak[(GPU, "train rank")] for s in phase.segments] == [1000, 600]
    assert phase.peak[(GPU, "train rank")] == 1000
    del kept
