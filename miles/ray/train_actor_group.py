"""The train ranks as Ray actors, driven together."""

from __future__ import annotations

import ray

from miles.backends.actor import TrainRank
from miles.backends.lora import LoraSpec
from miles.backends.types import RolloutBatch, TrainResult
from miles.ray.placement import PlacementPlan, actor_options


class TrainActor(TrainRank):
    def weight_update_refs(self) -> list[tuple[str, ray.ObjectRef]]:
        """(component, ref to its state dict): engines fetch the tensors from this actor's store."""
        return [(u.component, ray.put(u.state_dict)) for u in self.weight_updates()]

    def trained_components(self) -> list[str]:
        return list(self.components)


class TrainActorGroup:
    def __init__(self, args, plan, placement: PlacementPlan, pg, runtime_env: dict | None = None):
        world_size = len(placement.train)
        remote_cls = ray.remote(TrainActor)
        self.actors = [remote_cls.options(**actor_options(pg, slot, runtime_env)).remote(args, plan, rank, world_size)
                       for rank, slot in enumerate(placement.train)]
        master_addr, master_port = ray.get(self.actors[0].master_address.remote())
        ray.get([a.setup.remote(master_addr, master_port) for a in self.actors])

    def train(self, batch: RolloutBatch | ray.ObjectRef) -> list[TrainResult]:
        batch_ref = batch if isinstance(batch, ray.ObjectRef) else ray.put(batch)
        return ray.get([a.train.remote(batch_ref) for a in self.actors])

    def weight_update_refs(self) -> list[tuple[str, ray.ObjectRef]]:
        return ray.get(self.actors[0].weight_update_refs.remote())

    def lora_spec(self) -> LoraSpec | None:
        return ray.get(self.actors[0].lora_spec.remote())

    def components(self) -> list[str]:
        return ray.get(self.actors[0].trained_components.remote())

    def save(self, staging: str) -> None:
        ray.get([a.save.remote(staging) for a in self.actors])

    def load(self, path: str) -> None:
        ray.get([a.load.remote(path) for a in self.actors])

    def trained_state(self, rank: int = 0) -> dict:
        return ray.get(self.actors[rank].trained_state.remote())

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
