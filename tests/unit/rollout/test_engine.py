import dataclasses
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from miles.rollout.engine import RolloutEngine, create_engine_actor, engine_actor_options
from miles.rollout.types import SampleRequest, SamplingParams

PARAMS = SamplingParams(num_steps=3, height=32, width=32)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


def _requests(n=2):
    return [SampleRequest("a red cat", 0, i, 100 + i) for i in range(n)]


def _args(path, **kw):
    base = dict(hf_checkpoint=str(path), diffusion_model_family=None, device="cpu", rollout_num_gpus_per_engine=1,
                diffusion_num_steps=3, diffusion_height=32, diffusion_width=32, diffusion_output_num_frames=1,
                diffusion_guidance_scale=4.0, diffusion_guidance_scale_2=None, diffusion_noise_level=0.7,
                diffusion_sde_type=None, diffusion_shift=None, negative_prompt="", rollout_microgroup_size=None,
                rollout_dtype="float32", deterministic_mode=False)
    return SimpleNamespace(**{**base, **kw})


def _with_moved_transformer(checkpoint, out):
    """A copy of `checkpoint` whose transformer weights are moved by seeded noise: another
    checkpoint to push from, built without a second VAE fit (most of a tiny sd3 build)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    noise = torch.Generator().manual_seed(1)
    for path in (out / "transformer").glob("*.safetensors"):
        moved = {k: v + 0.05 * torch.randn(v.shape, generator=noise, dtype=v.dtype) for k, v in load_file(path).items()}
        save_file(moved, path, metadata={"format": "pt"})
    return out


def test_pushing_another_checkpoints_weights_makes_the_engine_sample_like_it(checkpoint, tmp_path):
    engine = RolloutEngine(checkpoint("sd3", 0), PARAMS, num_threads=1)
    other = RolloutEngine(_with_moved_transformer(checkpoint("sd3", 0), tmp_path / "other"), PARAMS, num_threads=1)
    before = engine.generate(_requests(), [0, 1])
    engine.load_weights("transformer", other.model.transformers["transformer"].state_dict())
    after, want = engine.generate(_requests(), [0, 1]), other.generate(_requests(), [0, 1])
    assert not torch.equal(before[0].latents, after[0].latents)
    # text encoder and VAE are still seed 0's, so compare the transformer's effect via velocity
    x, cond = after[0].latents[:1], after[0].cond
    assert torch.equal(engine.model.velocity(x, 1.0, cond, 4.0), other.model.velocity(x, 1.0, cond, 4.0))
    assert want[0].log_probs.shape == after[0].log_probs.shape


def test_lora_adapters_start_as_no_op_and_take_pushed_lora_weights(checkpoint):
    engine = RolloutEngine(checkpoint(), PARAMS, num_threads=1)
    base = engine.generate(_requests(1), [0, 1])[0]
    engine.apply_lora({"rank": 4, "alpha": 4})
    assert torch.equal(engine.generate(_requests(1), [0, 1])[0].latents, base.latents)
    lora = {k: torch.full_like(v, 0.02) for k, v in engine.model.transformers["transformer"].state_dict().items() if "lora_" in k}
    assert lora and all(k.split(".")[-2] == "default" for k in lora)
    engine.load_weights("transformer", {"base_model.model." + k: v for k, v in lora.items()})
    assert not torch.equal(engine.generate(_requests(1), [0, 1])[0].latents, base.latents)


def test_engine_from_flags_takes_sampling_settings_and_requires_wan_second_scale(checkpoint):
    engine = RolloutEngine.from_args(_args(checkpoint(), diffusion_num_steps=2, diffusion_noise_level=0.5))
    assert engine.params.num_steps == 2 and engine.params.noise_level == 0.5 and engine.family == "sd3"
    with pytest.raises(ValueError, match="guidance-scale-2"):
        RolloutEngine.from_args(_args(checkpoint("wan2_2")))


def test_cpu_engines_ask_ray_for_a_fraction_of_a_cpu_and_gpu_engines_for_their_gpus(checkpoint):
    assert engine_actor_options(_args(checkpoint()))["num_cpus"] < 1
    assert engine_actor_options(_args(checkpoint(), device="cuda", rollout_num_gpus_per_engine=2))["num_gpus"] == 2


def test_the_local_clusters_actors_run_the_pinned_kernels_this_process_runs(local_ray):
    """The comparison below is bit for bit: the actor must get the pins even if a test before it
    unpinned this worker's environment (an in-process GPU command does) before its cluster started."""
    from miles.utils.numerics import PINNED_ENV

    def numerics():
        import os

        import torch as torch_here
        from miles.utils.numerics import PINNED_ENV as names
        return {name: os.environ.get(name) for name in names}, torch_here.backends.cpu.get_cpu_capability()

    theirs = local_ray.get(local_ray.remote(numerics).options(num_cpus=0.25).remote())
    assert theirs == numerics() and theirs[0] == PINNED_ENV


def test_ray_actor_engine_returns_the_same_trajectories_as_a_local_engine_and_stores_what_a_run_reads(
        checkpoint, local_ray):
    ray = local_ray
    actor = create_engine_actor(_args(checkpoint()), num_threads=1)
    asked = [dataclasses.replace(r, output_steps=(1,) if r.sample_index else (), reward_frames=4, thumbnail=True)
             for r in _requests()]
    try:
        assert ray.get(actor.ready.remote()) == "sd3"
        remote = ray.get(actor.generate.remote(_requests(), [0, 1], True))
        stored = ray.get(actor.generate_to_store.remote(asked, [0, 1]))
        kept = ray.get([s.trajectory for s in stored])
        conds = ray.get([s.cond for s in stored])
        rewarded = ray.get([s.reward_input for s in stored])
    finally:
        ray.kill(actor)
    local = RolloutEngine(checkpoint(), SamplingParams.from_args(_args(checkpoint())), num_threads=1).generate(_requests(), [0, 1], True)
    for r, l in zip(remote, local):
        assert torch.equal(r.latents, l.latents) and torch.equal(r.log_probs, l.log_probs)
        assert torch.equal(r.model_outputs, l.model_outputs) and r.prompt == l.prompt
    # in a run the engine keeps each sample's trained steps (0, 1: latents 0..2) and the final latent,
    # the model outputs asked for, the group's conditioning once, and 8-bit pixels for the reward
    for request, s, t, cond, reward, l in zip(asked, stored, kept, conds, rewarded, local):
        assert t.latent_steps == [0, 1, 2, 3] and t.image is None and t.cond is None
        assert all(torch.equal(t.latent(k), l.latents[k]) for k in t.latent_steps)
        assert t.output_steps == (None if not request.output_steps else [1])
        assert request.output_steps == () or torch.equal(t.model_output(1), l.model_outputs[1])
        assert torch.equal(cond.positive["encoder_hidden_states"], l.cond.positive["encoder_hidden_states"])
        assert reward.image.dtype == np.uint8 and reward.image.shape == (3, 32, 32)
        assert s.thumbnail.dtype == np.uint8 and s.thumbnail.shape == (3, 32, 32) and s.num_steps == 3
    assert len({s.cond for s in stored}) == 1  # one prompt group: its conditioning stored once


def test_eval_samples_take_diffusion_eval_num_steps_and_training_samples_keep_num_steps(checkpoint):
    engine = RolloutEngine.from_args(_args(checkpoint(), diffusion_num_steps=3, diffusion_eval_num_steps=2))
    train, evaluated = engine.generate(_requests(1), [0]), engine.generate(_requests(1), [], evaluation=True)
    assert len(train[0].sigmas) == train[0].latents.shape[0] == 4  # 3 steps: 4 schedule points
    assert len(evaluated[0].sigmas) == evaluated[0].latents.shape[0] == 3  # 2 steps
    unset = RolloutEngine.from_args(_args(checkpoint(), diffusion_num_steps=3))
    assert len(unset.generate(_requests(1), [], evaluation=True)[0].sigmas) == 4
