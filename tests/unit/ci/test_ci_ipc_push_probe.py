"""The CUDA IPC push probe (ci/ipc_push_probe.py), run on the CPU through the push path's own ends
(miles.backends.ipc_push): its plan keeps the probe's dtypes and holds an oversize tensor, and
every weight arrives bit for bit through handles of one reused buffer."""

import torch

from ci import ipc_push_probe as probe
from miles.backends.ipc_push import buffer_bytes


def test_the_plan_keeps_each_dtype_and_one_tensor_outgrows_a_bucket():
    plan = probe.plan_for(probe.weights(0, "cpu"))
    assert {b.dtype for b in plan.buckets} == {"float32", "bfloat16"}
    assert any(plan.oversize(b) for b in plan.buckets)
    assert buffer_bytes(plan) == max(b.nbytes for b in plan.buckets) > probe.BUCKET_BYTES


def test_every_weight_arrives_bit_for_bit_through_the_reused_buffer():
    # exact: the bytes are copied, never computed; a wrong offset or a buffer overwritten before
    # the engine copied it shows as a difference of order 1 (the weights are standard normal)
    assert probe.push("cpu") == 0.0
