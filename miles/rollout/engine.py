"""Rollout engines: a plain `RolloutEngine`, and `RolloutEngineActor`, its Ray wrapper.

An engine owns one loaded checkpoint on one device, samples trajectories for requests, and takes
weights from the trainer (full tensors or LoRA tensors, after `apply_lora`).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from miles.models.loader import DiffusionModel, load_model
from miles.models.runtime import configure_torch
from miles.rollout import sampler
from miles.rollout.engine_offload import EngineOffload, reload_weights, resident_while_sampling
from miles.rollout.engine_store import SampleStore
from miles.rollout.types import SampleRequest, SamplingParams, StoredSample, Trajectory
from miles.records import phases

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RolloutEngine:
    def __init__(self, checkpoint: str | Path, params: SamplingParams, family: str | None = None,
                 device: str = "cpu", dtype: torch.dtype | str = torch.float32,
                 num_threads: int | None = None, deterministic: bool = False, offload: bool = False):
        phases.actor_init("rollout engine")
        configure_torch(deterministic=deterministic, num_threads=num_threads)
        dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.params = params
        self.model: DiffusionModel = load_model(checkpoint, family=family, device=device, dtype=dtype)
        sampler.guidance_scales(self.model, params)  # a missing Wan2.2 second scale fails at start
        self.offloaded_weights = EngineOffload(self.model) if offload else None  # --offload-rollout
        phases.actor_ready("rollout engine")

    @classmethod
    def from_args(cls, args, device: str | None = None, num_threads: int | None = None) -> "RolloutEngine":
        return cls(
            args.hf_checkpoint, SamplingParams.from_args(args), family=args.diffusion_model_family,
            device=device or ("cuda" if args.device == "cuda" else "cpu"),
            dtype=getattr(args, "rollout_dtype", "float32") or "float32",
            num_threads=num_threads, deterministic=getattr(args, "deterministic_mode", False),
            offload=getattr(args, "offload_rollout", False),
        )

    @property
    def family(self) -> str:
        return self.model.family

    def generate(self, requests: list[SampleRequest], trained_steps: list[int], debug: bool = False,
                 evaluation: bool = False) -> list[Trajectory]:
        """`evaluation`: eval samples, with --diffusion-eval-num-steps steps when set."""
        params = self.params.for_eval() if evaluation else self.params
        with resident_while_sampling(self.offloaded_weights):
            return sampler.generate(self.model, requests, params, trained_steps, debug)

    def apply_lora(self, rank: int | dict, alpha: float | None = None, target_modules: list[str] | None = None,
                   components: list[str] | None = None) -> None:
        """Inject LoRA adapters as the trainer does; `rank` may be a dict of these arguments."""
        reload_weights(self.offloaded_weights)
        if isinstance(rank, dict):
            self.model.apply_lora(**rank)
        else:
            self.model.apply_lora(rank, alpha, target_modules, components)

    def load_weights(self, component: str, state_dict: dict[str, torch.Tensor]) -> None:
        reload_weights(self.offloaded_weights)
        self.model.load_weights(component, state_dict)
        self._offload_after_update()

    def join_weight_sync(self, address, rank: int, plan) -> None:
        """Join the bucketed weight-sync group (miles.backends.sync_group) as `rank`."""
        from miles.backends.sync_group import WeightReceiver

        self.weight_receiver = WeightReceiver(address, rank, plan, self.model.parts)

    def receive_weights(self) -> int:
        """One bucketed weight update, copied in place; the most staging bytes it held at once."""
        reload_weights(self.offloaded_weights)
        peak = self.weight_receiver.receive().peak
        self._offload_after_update()
        return peak

    # the colocated push (miles.backends.ipc_push): this engine's train rank drives it, bucket by bucket
    def open_ipc_push(self, handle: bytes, plan) -> None:
        from miles.backends.ipc_push import IpcReceiver

        self.ipc_receiver = IpcReceiver(handle, plan, self.model.parts)

    def begin_ipc_push(self) -> None:
        reload_weights(self.offloaded_weights)
        self.ipc_receiver.begin()

    def receive_ipc_bucket(self, index: int) -> None:
        """Copy one bucket out of the rank's buffer into the weights in place; returning is the ack."""
        self.ipc_receiver.receive(index)

    def end_ipc_push(self) -> None:
        self._offload_after_update()

    def _offload_after_update(self) -> None:
        """--offload-rollout: updated weights go back to the host until the next generate. A
        checkpoint save follows a weight push, and the colocated rank brings its whole state back
        for it: with the engine still resident, Qwen-Image full's save needs 74.7 GiB of a 72 GiB
        budget (python3 -m miles.replay, docs/memory-plan.md)."""
        if self.offloaded_weights is not None:
            self.offloaded_weights.weights.offload(self.offloaded_weights.tensors())

    def sampling_params(self) -> dict:
        return asdict(self.params)


class RolloutEngineActor(RolloutEngine):
    """The engine inside a Ray actor; create with `create_engine_actor`."""

    def ready(self) -> str:
        return self.family

    def weight_digests(self) -> dict[str, str]:
        """Each transformer tensor's dtype and checksum as this engine holds it (--stop-on-parity-drift)."""
        from miles.models.precision import weight_digests

        with resident_while_sampling(self.offloaded_weights):
            return weight_digests(self.model.transformers)

    def generate(self, requests, trained_steps, debug=False, evaluation=False):
        from miles.flags.debug_faults import fire

        fire(self, "engine-kill")  # --debug-fault engine-kill@N (the fault suite)
        return super().generate(requests, trained_steps, debug, evaluation)

    def generate_to_store(self, requests: list[SampleRequest], trained_steps: list[int], evaluation: bool = False,
                          train: bool = True) -> list[StoredSample]:
        """A run's samples: each kept in Ray's object store by this engine (miles.rollout.engine_store),
        the caller answered with where they lie. Model outputs are recorded where a request asks;
        `train`: train ranks will read the trajectories (else only what the rewards score is kept)."""
        import ray

        from miles.flags.debug_faults import fire

        fire(self, "engine-kill")
        store = SampleStore(ray.put, train)
        params = self.params.for_eval() if evaluation else self.params
        debug = any(r.output_steps for r in requests)
        with resident_while_sampling(self.offloaded_weights):
            return sampler.generate(self.model, requests, params, trained_steps, debug, finish=store.keep)


def engine_actor_options(args) -> dict:
    """Ray resources for one engine: its GPUs, or a fraction of a CPU so a 2-CPU head fits it."""
    if args.device == "cuda":
        return {"num_gpus": args.rollout_num_gpus_per_engine, "num_cpus": 1}
    return {"num_gpus": 0, "num_cpus": 0.25}


def create_engine_actor(args, num_threads: int | None = None, **ray_options):
    """One RolloutEngineActor for these flags; extra options (e.g. a placement group) pass to Ray."""
    import ray

    options = {**engine_actor_options(args), **ray_options}
    return ray.remote(RolloutEngineActor).options(**options).remote(
        args.hf_checkpoint, SamplingParams.from_args(args), args.diffusion_model_family,
        "cuda" if args.device == "cuda" else "cpu", getattr(args, "rollout_dtype", "float32") or "float32",
        num_threads, getattr(args, "deterministic_mode", False), getattr(args, "offload_rollout", False),
    )
