"""The replay's weight push (miles.replay.run's "weight push" phase): the recipe's transport,
both ends driven in one process on meta tensors."""

from __future__ import annotations

import torch

from miles.replay.memory import ENGINE, RANK, TRAIN_GPU, LiveMemory


def weight_push(memory: LiveMemory, args, rank, engine, places: dict[str, str]) -> None:
    """The bucketed sync of miles.ray.weight_sync_group: rank 0 packs its synced tensors into
    buckets, the engine copies each bucket into its weights; both sides resident as offload has
    them. Colocated (the IPC transport): one reused buffer on the rank's device, which the engine
    copies out of without staging anything; else the broadcast, one bucket staged on each side."""
    from miles.backends.train_offload import resident
    from miles.backends.weight_buckets import plan_buckets, send_buckets
    from miles.flags.validation import DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE

    buffer = getattr(args, "update_weight_buffer_size", None) or DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE
    with memory.at(TRAIN_GPU, RANK), resident(rank.offload, optimizer=False, synced_only=True):
        buckets = plan_buckets(rank.synced_tensors(), rank.wire_rule(), buffer)
        tensors = {(c, n): t for c, n, t in rank.synced_tensors()}
        if args.colocate:  # the transport miles.ray.weight_sync_group.push_transport picks
            _ipc_push(memory, buckets, tensors, rank, engine, places[ENGINE])
            return
        send_buckets(buckets, tensors, lambda t: None, rank.device)
    with memory.at(places[ENGINE], ENGINE):
        engine.weight_receiver = _Receiver(buckets, engine.model.parts)
        engine.receive_weights()


def _ipc_push(memory: LiveMemory, buckets, tensors, rank, engine, engine_place: str) -> None:
    """miles.backends.ipc_push's two ends in one process: the engine's end opens the rank's own
    buffer (no handle to pickle on meta tensors) and copies each bucket out as the rank delivers it."""
    from unittest import mock

    from miles.backends import ipc_push

    with mock.patch.object(ipc_push, "share", lambda buffer: b""):
        sender = ipc_push.IpcSender(buckets, rank.device)
    with memory.at(engine_place, ENGINE), mock.patch.object(ipc_push, "open_shared", lambda handle: sender.buffer):
        engine.open_ipc_push(sender.handle, buckets)
        engine.begin_ipc_push()

    def deliver(index: int) -> None:
        with memory.at(engine_place, ENGINE):
            engine.receive_ipc_bucket(index)

    sender.send(tensors, deliver)
    with memory.at(engine_place, ENGINE):
        engine.end_ipc_push()


class _Receiver:
    """The engine's end of the bucketed sync (miles.backends.sync_group.WeightReceiver) without its
    process group: every bucket arrives at once (the fake group moves no bytes)."""

    def __init__(self, plan, parts):
        self.plan, self.parts = plan, parts

    def receive(self):
        from miles.backends.weight_buckets import engine_targets, receive_buckets

        return receive_buckets(self.plan, engine_targets(self.parts, self.plan), lambda t: None,
                               torch.device("meta"))
