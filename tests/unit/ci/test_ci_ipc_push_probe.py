"""The CUDA IPC push probe's protocol (ci/ipc_push_probe.py), run on the CPU: the buckets it
packs, and every weight arriving bit for bit through handles of one reused buffer."""

import torch

from ci import ipc_push_probe as probe


def test_buckets_keep_one_dtype_and_stay_within_the_bucket_size_unless_one_tensor_is_larger():
    sent = probe.weights(0, "cpu")
    packed = probe.buckets(list(sent), sent)
    assert [n for bucket in packed for n in bucket] == list(sent)
    for bucket in packed:
        assert len({sent[n].dtype for n in bucket}) == 1
        assert len(bucket) == 1 or sum(sent[n].numel() for n in bucket) <= probe.BUCKET_ELEMENTS
    assert {sent[n].dtype for n in sent} == {torch.float32, torch.bfloat16}


def test_every_weight_arrives_bit_for_bit_through_the_reused_buffer():
    # exact: the bytes are copied, never computed; a wrong offset or a buffer overwritten before
    # the engine copied it shows as a difference of order 1 (the weights are standard normal)
    assert probe.push("cpu") == 0.0
