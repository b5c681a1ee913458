"""Every collective of a train step gets tensors its backend serves, on CPU and on GPU alike.

The bug this guards: `_reduce` all-reduced CPU float64 metric tensors over the rank's group,
which was NCCL-only on CUDA, so every multi-rank GPU run failed at the end of its first step
while every CPU test passed. Here two real gloo ranks run a train step through the same code a
GPU rank runs; every collective they make is recorded, and each tensor's device must be served
both by the backend in use and by the backend a GPU rank would use.
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch

from miles.backends.collectives import (
    CollectiveDeviceError, Collectives, backend_for, supported_devices,
)


def test_one_backend_rule_for_both_devices():
    assert backend_for("cpu") == "gloo" and supported_devices("gloo") == {"cpu"}
    # a GPU rank reduces CUDA gradients over NCCL and CPU metric scalars over gloo
    assert backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert supported_devices(backend_for("cuda")) == {"cpu", "cuda"}
    assert supported_devices("nccl") == {"cuda"}
    with pytest.raises(ValueError):
        backend_for("mps")


def test_a_tensor_the_backend_cannot_take_is_refused_before_torch_sees_it():
    # what the old code did on a GPU rank: a CPU metric tensor into an NCCL-only group
    comm = Collectives(torch.device("cpu"), world_size=2, backend="nccl")
    with pytest.raises(CollectiveDeviceError, match="all_reduce.*cpu tensor on a 'nccl' process group"):
        comm.all_reduce(comm.metric_tensor([1.0, 2.0]))


class _TwoIdenticalRanks(Collectives):
    """A world of two whose other rank holds the same tensors: the collectives' results without a peer.

    Everything else (the device check, which tensors the step hands over) is the real code; the
    real two-process gloo group runs in tests/unit/ray/test_data_parallel.py.
    """

    def init_process_group(self, rank, master_addr, master_port, always=False, store=None):
        pass

    def all_reduce(self, tensor, op="sum"):
        self.check(f"all_reduce({op})", tensor)
        if op == "sum":
            tensor.mul_(self.world_size)
        return tensor

    def broadcast(self, tensor, src=0):
        self.check("broadcast", tensor)
        return tensor


def test_every_collective_of_a_train_step_gets_tensors_the_cpu_and_the_gpu_backend_serve(tmp_path, monkeypatch):
    import miles.backends.actor as actor
    from dtype_helpers import one_rollout, tiny_args

    # a rank's optimizer step holds one sample (at 2 steps), so the engines sample one at a time to match
    args, plan = tiny_args(tmp_path, "--actor-num-gpus-per-node 2 --num-gpus-per-node 2 --colocate "
                                     "--rollout-microgroup-size 1")
    batch = one_rollout(args, rollout_id=0)
    monkeypatch.setattr(actor, "Collectives", _TwoIdenticalRanks)
    rank = actor.TrainRank(args, plan, 0, 2)
    rank.setup("127.0.0.1", 0)
    metrics = rank.train(batch).metrics
    calls = rank.comm.calls
    ops = [op for op, _, _ in calls]
    # the initial weight broadcast, one gradient all-reduce per optimizer step, the metric reductions
    assert ops.count("broadcast") == len(rank.params)
    assert ops.count("all_reduce(sum)") == plan.num_steps_per_rollout + 2 and ops.count("all_reduce(max)") == 1
    gpu_backend = backend_for("cuda")
    for op, backend, device in calls:
        assert backend == backend_for("cpu") and device in supported_devices(backend), (op, device)
        # on a GPU rank this tensor is on the CPU (metrics) or the rank's device: both must be served
        assert {device, "cuda"} <= supported_devices(gpu_backend), (op, device, gpu_backend)
    assert metrics["train/model_output_max_abs_diff"] == 0.0
    # the same assertion against the old NCCL-only group fails on the metric tensors: the bug caught
    assert any(device not in supported_devices("nccl") for _, _, device in calls)


def test_rank_zero_reports_the_port_its_group_store_is_already_listening_on():
    """Rank 0 used to report a port found free and bind it later, when it set up; any process
    could take the port in between (EADDRINUSE under the parallel suite). Now the port it reports
    is one its store holds already: nothing else can bind it, and a rank connecting finds it."""
    import torch.distributed as dist

    from miles.backends.actor import TrainRank

    rank0 = TrainRank.__new__(TrainRank)  # master_address reads nothing of the rank's set-up
    host, port = rank0.master_address()
    with socket.socket() as other, pytest.raises(OSError):
        other.bind((host, port))
    peer = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    peer.set("joined", "1")
    assert rank0.group_store.get("joined") == b"1"
