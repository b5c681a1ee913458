"""The train ranks as Ray actors, driven together."""

from __future__ import annotations

import contextlib
import time

import ray

from miles.backends.actor import TrainRank
from miles.backends.lora import LoraSpec
from miles.backends.train_offload import resident
from miles.backends.collectives import host_store
from miles.backends.ipc_push import IpcSender
from miles.backends.sync_group import SyncGroupAddress, WeightSender
from miles.backends.weight_buckets import BucketPlan, plan_buckets, send_buckets
from miles.backends.rollout_shard import fetch_shard, rank_shard
from miles.backends.types import RolloutBatch, RolloutRefs, TrainResult
from miles.ray import faults
from miles.ray.faults import wait_for
from miles.flags.debug_faults import SLOW_SAVE_S, fire, take
from miles.ray.placement import PlacementPlan, actor_options


class TrainActor(TrainRank):
    def weight_update_refs(self) -> list[tuple[str, ray.ObjectRef]]:
        """(component, ref to its state dict): engines fetch the tensors from this actor's store.
        Sharded ranks all gather (a collective); only rank 0 hands its copy over."""
        updates = self.weight_updates()
        return [(u.component, ray.put(u.state_dict)) for u in updates] if self.rank == 0 else []

    # bucketed weight sync (miles.ray.weight_sync_group): rank 0 sends, every rank joins the gathers
    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the weight-sync group's store: this node's address and the port its
        store is listening on already (the engines connect to it when they join)."""
        host = ray.util.get_node_ip_address()
        self.sync_store = host_store(host, self.args.remote_timeout_s)
        return host, self.sync_store.port

    def weight_bucket_plan(self, buffer_bytes: int) -> BucketPlan:
        with resident(self.offload, optimizer=False, synced_only=True):  # the plan reads shapes and dtypes
            return plan_buckets(self.synced_tensors(), self.wire_rule(), buffer_bytes)

    def join_weight_sync(self, address: SyncGroupAddress | None, plan: BucketPlan, engines: list | None = None) -> None:
        """`address`: the broadcast group's (rank 0 sends). `engines`: this rank's colocated engines,
        which it serves through IPC handles of its own buffer (miles.backends.ipc_push)."""
        self.bucket_plan = plan
        self.weight_sender = WeightSender(address, plan, self.sync_store) if address and self.rank == 0 else None
        self.ipc_engines = list(engines or [])
        self.ipc_sender = IpcSender(plan, self.device) if self.ipc_engines else None
        if self.ipc_sender is not None:
            try:
                ray.get([e.open_ipc_push.remote(self.ipc_sender.handle, plan) for e in self.ipc_engines])
            finally:
                self.ipc_sender.opened()  # opened or failed, no one opens it by name again

    def send_weights(self) -> int:
        """Rank 0 broadcasts, or each rank hands its own engines the buffer (IPC); a rank with
        neither only takes part in gathering sharded tensors. Returns the most staging bytes this
        rank held at once."""
        with resident(self.offload, optimizer=False, synced_only=True):  # --offload-train
            tensors = {(c, n): t for c, n, t in self.synced_tensors()}
            if self.ipc_sender is not None:
                return self._send_ipc(tensors)
            if self.weight_sender is not None:
                return self.weight_sender.send(tensors).peak
            return send_buckets(self.bucket_plan, tensors, None, self.device).peak

    def _send_ipc(self, tensors) -> int:
        engines = self.ipc_engines
        ray.get([e.begin_ipc_push.remote() for e in engines])
        staging = self.ipc_sender.send(tensors, lambda index: ray.get([e.receive_ipc_bucket.remote(index)
                                                                      for e in engines]))
        ray.get([e.end_ipc_push.remote() for e in engines])
        return staging.peak

    def trained_components(self) -> list[str]:
        return list(self.components)

    def setup_at(self, master: tuple[str, int]) -> None:
        """`setup` with rank 0's (address, port) as one argument: the driver hands over the ref to
        rank 0's answer, so the ranks set up without the driver waiting for it."""
        self.args = faults.args_for_setup(self.args, self.rank, self.world_size)  # --debug-fault train-setup@0
        self.setup(*master)

    # fault injection (--debug-fault, miles.flags.debug_faults): armed by the driver, carried out here
    def train(self, batch):
        fire(self, "train-kill")
        if isinstance(batch, RolloutRefs):  # a run's rollout: this rank's samples, from where the engines keep them
            batch = fetch_shard(batch, ray.get)
        try:
            return super().train(batch)
        finally:
            if getattr(self, "_miles_fault", None) == "nan":
                self._miles_fault = None

    def _micro_batch_loss(self, *args, **kwargs):
        loss, metrics = super()._micro_batch_loss(*args, **kwargs)
        if getattr(self, "_miles_fault", None) == "nan":
            loss = loss * float("nan")
        return loss, metrics

    def begin_save(self, staging: str) -> None:
        fire(self, "disk-full")
        slow = take(self, "slow-save")
        with _disk_reason_named(staging):
            super().begin_save(staging)
        if slow:  # the background write, not the train step, takes the 20 s
            self.pending_save.also(lambda: time.sleep(SLOW_SAVE_S))
        self._saving_to = staging

    def finish_save(self) -> None:
        with _disk_reason_named(getattr(self, "_saving_to", "")):
            super().finish_save()


@contextlib.contextmanager
def _disk_reason_named(staging: str):
    """Serializers hide the OS's reason for a failed write (torch: "unexpected pos ..."): find it."""
    try:
        yield
    except Exception as err:
        reason = faults.disk_reason(staging) if staging else None
        if reason is None:
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        raise OSError(reason.errno, f"{reason.strerror} while saving the checkpoint to {staging} "
                                    f"({type(err).__name__}: {first})") from err


class TrainActorGroup:
    """The train ranks. Constructing the group starts them and their set-up without waiting, so
    the engines can start meanwhile (actor start-up is most of a small run's time); `wait_ready()`
    waits for the set-up to end."""

    def __init__(self, args, plan, placement: PlacementPlan, pg, runtime_env: dict | None = None):
        world_size = len(placement.train)
        self.plan = plan
        self.sharded = getattr(args, "train_backend", "dp") == "fsdp"  # gathers need every rank
        remote_cls = ray.remote(TrainActor)
        self.actors = [remote_cls.options(**actor_options(pg, slot, runtime_env)).remote(args, plan, rank, world_size)
                       for rank, slot in enumerate(placement.train)]
        faults.watch_creation(self.actors, "train rank")
        master = self.actors[0].master_address.remote()
        self._setup = [a.setup_at.remote(master) for a in self.actors]
        faults.watch_calls(self._setup, self.actors, "setup")

    def wait_ready(self) -> "TrainActorGroup":
        self._get(self._setup, "setup")
        faults.ROSTER.register(self.actors, "train rank")
        return self

    def _get(self, refs: list, what: str, actors: list | None = None) -> list:
        """ray.get with a deadline; a dead or silent rank becomes a RunFailure naming it."""
        return wait_for(refs, actors or self.actors, what)

    def train(self, batch: RolloutRefs | RolloutBatch | ray.ObjectRef) -> list[TrainResult]:
        """A rollout goes out as one shard per rank (miles.backends.rollout_shard): a rank never
        deserialises the trajectories other ranks train on. A run's rollout (`RolloutRefs`) goes as
        references: each rank fetches its samples from the object store. Anything else goes whole."""
        sharded = 1 < len(self.actors) == self.plan.dp_size
        if isinstance(batch, RolloutRefs):
            shards = [rank_shard(batch, self.plan, rank) if sharded else batch for rank in range(len(self.actors))]
        elif isinstance(batch, RolloutBatch) and sharded:
            shards = [ray.put(rank_shard(batch, self.plan, rank)) for rank in range(len(self.actors))]
        else:
            shards = [batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)] * len(self.actors)
        return self._get([a.train.remote(shard) for a, shard in zip(self.actors, shards)], "train")

    def weight_update_refs(self) -> list[tuple[str, ray.ObjectRef]]:
        actors = self.actors if self.sharded else self.actors[:1]
        return self._get([a.weight_update_refs.remote() for a in actors], "weight_update_refs", actors)[0]

    def lora_spec(self) -> LoraSpec | None:
        return self._get([self.actors[0].lora_spec.remote()], "lora_spec", self.actors[:1])[0]

    def components(self) -> list[str]:
        return self._get([self.actors[0].trained_components.remote()], "components", self.actors[:1])[0]

    def begin_save(self, staging: str) -> None:
        """Every rank copies the checkpoint's state to the host and starts writing it in the
        background (miles.backends.checkpoint_writer); returns once the copies are taken."""
        self._get([a.begin_save.remote(staging) for a in self.actors], "save")

    def save_done(self) -> bool:
        """Whether every rank's background write has ended (asks, never waits for the write)."""
        return all(self._get([a.save_done.remote() for a in self.actors], "checkpoint write"))

    def finish_save(self) -> None:
        """Until every rank's write has ended; a rank's write error is raised here."""
        self._get([a.finish_save.remote() for a in self.actors], "checkpoint write")

    def load(self, path: str) -> None:
        self._get([a.load.remote(path) for a in self.actors], "load")

    def trained_state(self, rank: int = 0) -> dict:
        actors = self.actors if self.sharded else [self.actors[rank]]
        states = self._get([a.trained_state.remote() for a in actors], "trained_state", actors)
        return states[rank] if self.sharded else states[0]

    def weight_digests(self) -> dict[str, str]:
        """Rank 0's compute-side digests (fsdp: every rank gathers)."""
        actors = self.actors if self.sharded else self.actors[:1]
        return self._get([a.weight_digests.remote() for a in actors], "weight_digests", actors)[0]

    def shutdown(self) -> None:
        faults.WATCH.forget(self.actors)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
