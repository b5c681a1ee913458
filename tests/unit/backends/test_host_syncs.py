"""A train step's device work makes no host round trip: counted on `meta` tensors standing for
device tensors (tests/tools/host_syncs.py), so a new `.item()` / `.cpu()` inside the step fails
here on a CPU machine."""

from __future__ import annotations

import torch

from miles.backends import fsdp
from miles.backends.ema import EMA
from miles.backends.optimizer import build_optimizer
from tests.tools.host_syncs import DEVICE, HostSyncCounter


class AdamArgs:
    lr, adam_beta1, adam_beta2, adam_eps, weight_decay = 1e-3, 0.9, 0.999, 1e-8, 0.01


def sharded_params(count: int) -> list[torch.nn.Parameter]:
    """Parameters whose gradients answer `to_local()` as a DTensor's do (here: the whole shard)."""
    params = []
    for i in range(count):
        p = torch.nn.Parameter(torch.empty(4, 3 + i, device=DEVICE))
        p.grad = torch.empty_like(p)
        p.grad.to_local = (lambda g=p.grad: g)
        params.append(p)
    return params


def test_clip_gradients_on_sharded_gradients_reads_nothing_back_from_the_device():
    with HostSyncCounter() as counter:
        norm = fsdp.clip_gradients(sharded_params(5), max_norm=1.0)
    assert counter.syncs == []
    assert isinstance(norm, torch.Tensor) and norm.device.type == DEVICE  # read once, with the step's metrics


def test_an_ema_swap_an_adamw_step_and_an_ema_update_read_nothing_back_from_the_device():
    with HostSyncCounter() as counter:
        params = {f"w{i}": p for i, p in enumerate(sharded_params(3))}
        ema = EMA(params, 0.9)
        with ema.swapped_in(params):
            pass
        build_optimizer(list(params.values()), AdamArgs).step()
        build_optimizer(list(params.values()), AdamArgs).step()
        ema.update(params)
    assert counter.syncs == []


def test_the_counter_sees_a_read_and_a_copy_to_the_host():
    with HostSyncCounter() as counter:
        t = torch.empty(3, device=DEVICE)
        float(t.sum())
        t.cpu()
        torch.empty(3).copy_(t)
    assert len(counter.syncs) == 3
