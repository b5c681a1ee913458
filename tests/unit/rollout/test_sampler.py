
import pytest
import torch

from miles.models.loader import load_model
from miles.rollout import sampler
from miles.rollout.sde import largest_sigma_below_one, sde_step
from miles.rollout.types import Conditioning, SampleRequest, SamplingParams
from miles.diffusion_facts.families import FAMILY_NAMES

PARAMS = dict(num_steps=4, height=32, width=32, guidance_scale=4.0, guidance_scale_2=3.0, negative_prompt="blurry")


@pytest.fixture(scope="module")
def model_of(tiny_checkpoint):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_model(tiny_checkpoint(family))
        return cache[family]

    return get


def _requests(n=4, groups=2, seed=10):
    return [SampleRequest(f"prompt number {i % groups}", i % groups, i // groups, seed + i, {"k": i}) for i in range(n)]


def _params(model, **overrides):
    frames = 5 if model.spec.is_video else 1
    return SamplingParams(**{**PARAMS, "num_frames": frames, **overrides})


def _microgroups_of(trajectories):
    """The engine's microgroups (microgroup_size None: all samples of a prompt), in request order."""
    groups = {}
    for t in trajectories:
        groups.setdefault(t.group_index, []).append(t)
    return list(groups.values())


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_log_probs_and_outputs_recomputed_on_the_engines_microgroup_equal_the_engines(family, model_of):
    """The trainer's recomputation: the microgroup's samples at one step, in the engine's order, with
    autograd recording, give the engine's bits exactly."""
    model = model_of(family)
    trajectories = sampler.generate(model, _requests(), _params(model), trained_steps=[0, 1, 2], debug=True)
    for tile in _microgroups_of(trajectories):
        assert len(tile) == 2
        first = tile[0]
        sigmas = first.sigmas.tolist()
        cond = Conditioning.cat([t.cond for t in tile])
        for k in range(first.num_steps):
            x = torch.stack([t.latents[k] for t in tile])
            with torch.enable_grad():  # the trainer's recomputation
                v = model.velocity(x, sigmas[k], cond, first.guidance_scales[k], first.experts[k], detach_uncond=True)
            kind = first.sde_type if k in first.trained_steps else "ode"
            step = sde_step(x, v, sigmas[k], sigmas[k + 1], first.noise_level, kind,
                            x_next=torch.stack([t.latents[k + 1] for t in tile]),
                            sigma_max=largest_sigma_below_one(sigmas))
            assert torch.equal(v.detach(), torch.stack([t.model_outputs[k] for t in tile]))
            assert torch.equal(step.log_prob.detach(), torch.stack([t.log_probs[k] for t in tile]))
    for t in trajectories:
        assert t.image.min() >= 0 and t.image.max() <= 1
        assert t.image.shape[-3:] == (3, 32, 32)
        assert t.image.ndim == (4 if model.spec.is_video else 3)


def test_trajectory_records_every_step(model_of):
    model = model_of("sd3")
    (t,) = sampler.generate(model, _requests(1), _params(model), trained_steps=[1, 2])
    assert t.latents.shape == (5, *model.latent_shape(32, 32))
    assert t.sigmas[0] == 1.0 and t.sigmas[-1] == 0.0 and t.sigmas.shape == (5,)
    assert t.log_probs.shape == (4,) and t.trained_steps == [1, 2]
    assert t.model_outputs is None  # only in debug mode
    assert t.metadata == {"k": 0} and t.sde_type == "sde" and t.seed == 10
    assert t.cond.batch_size == 1 and t.cond.negative is not None


def test_steps_outside_the_trained_set_run_as_ode(model_of):
    model = model_of("sd3")
    (t,) = sampler.generate(model, _requests(1), _params(model), trained_steps=[2], debug=True)
    assert (t.log_probs[[0, 1, 3]] == 0).all() and t.log_probs[2] != 0
    s = t.sigmas
    assert torch.equal(t.latents[1], t.latents[0] + t.model_outputs[0] * (s[1] - s[0]))


def test_trajectories_are_ordinary_tensors_a_trainer_can_differentiate_through(model_of):
    """The engine samples in inference mode; what it returns must still enter autograd (a
    colocated or local trainer receives the tensors themselves, not a pickled copy)."""
    model = model_of("sd3")
    (t,) = sampler.generate(model, _requests(1), _params(model), trained_steps=[1], debug=True)
    tensors = [t.latents, t.log_probs, t.image, t.model_outputs, t.sigmas,
               *t.cond.positive.values(), *t.cond.negative.values()]
    assert not any(x.is_inference() for x in tensors)
    weight = torch.ones((), requires_grad=True)
    sum((weight * x.float()).sum() for x in tensors).backward()
    assert weight.grad is not None


def test_a_samples_steps_do_not_depend_on_which_later_steps_are_trained(model_of):
    """A sample's draw k + 1 is step k's noise however many draws the run needs after it."""
    model = model_of("sd3")
    (short,) = sampler.generate(model, _requests(1), _params(model), trained_steps=[1])
    (long,) = sampler.generate(model, _requests(1), _params(model), trained_steps=[1, 3])
    assert torch.equal(short.latents[:4], long.latents[:4]) and not torch.equal(short.latents[4], long.latents[4])


def test_a_sample_is_the_same_whatever_the_engine_split_or_the_order_of_prompts(model_of):
    """An engine receives whole prompts; its microgroups, and so its samples' bits, do not depend on
    which other prompts it got or in which order."""
    model = model_of("sd3")
    reqs = _requests(4)
    together = sampler.generate(model, reqs, _params(model), trained_steps=[0, 1])
    split = [sampler.generate(model, [r for r in reqs if r.group_index == g], _params(model), trained_steps=[0, 1])
             for g in (1, 0)]
    apart = {(t.group_index, t.sample_index): t for part in split for t in part}
    for x in together:
        y = apart[(x.group_index, x.sample_index)]
        assert torch.equal(x.latents, y.latents) and torch.equal(x.log_probs, y.log_probs)
        assert torch.equal(x.image, y.image)
    assert not torch.equal(together[0].latents, together[2].latents)  # same prompt, different seed


def _forward_batches(model, run):
    batches = []
    hook = model.transformers["transformer"].register_forward_hook(
        lambda mod, args, kwargs, out: batches.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return batches


@pytest.mark.parametrize("microgroup_size, batch", [(1, 2), (None, 4)])
def test_microgroup_size_is_the_batch_of_every_forward(model_of, microgroup_size, batch):
    """One transformer call per step and microgroup; SD3 guides as its pipeline does, in one call on
    [negative; prompt], so a microgroup of m samples is a forward of 2 m."""
    model = model_of("sd3")
    params = _params(model, microgroup_size=microgroup_size)
    batches = _forward_batches(model, lambda: sampler.generate(model, _requests(4), params, trained_steps=[0]))
    microgroups = 4 // (batch // 2)
    assert batches == [batch] * (params.num_steps * microgroups)


def test_each_distinct_text_is_encoded_once_per_call_whatever_the_microgroups(model_of):
    """Four microgroups of one sample over two prompts: two prompt encodings and one of the negative
    prompt, not one of each per microgroup."""
    model = model_of("sd3")
    params = _params(model, microgroup_size=1, negative_prompt="grainy, seen by this test only")
    calls = []
    hook = model.text_encoders["text_encoder"].register_forward_hook(lambda *_: calls.append(1))
    try:
        trajectories = sampler.generate(model, _requests(4), params, trained_steps=[0])
    finally:
        hook.remove()
    assert len(calls) == 3 and len(trajectories) == 4


def test_microgroups_never_mix_prompt_groups():
    chunks = sampler._microgroups(_requests(6, groups=2), size=2)
    assert [[r.group_index for r in c] for c in chunks] == [[0, 0], [0], [1, 1], [1]]


def test_wan_uses_high_noise_expert_above_the_boundary_and_low_noise_below(model_of):
    model = model_of("wan2_2")
    params = _params(model, num_steps=6, shift=3.0)
    calls = []
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: calls.append(name))
             for name, m in model.transformers.items()]
    try:
        (t,) = sampler.generate(model, _requests(1), params, trained_steps=[0])
    finally:
        for h in hooks:
            h.remove()
    per_step = [calls[2 * k : 2 * k + 2] for k in range(params.num_steps)]  # prompt pass, negative pass
    for k, sigma in enumerate(t.sigmas[:-1].tolist()):
        want = "transformer" if sigma * 1000 >= 875 else "transformer_2"
        assert per_step[k] == [want, want] and t.experts[k] == want
        assert t.guidance_scales[k] == (4.0 if want == "transformer" else 3.0)
    assert set(t.experts) == {"transformer", "transformer_2"}


def test_wan_requires_its_second_guidance_scale(model_of):
    model = model_of("wan2_2")
    with pytest.raises(ValueError, match="guidance-scale-2"):
        sampler.generate(model, _requests(1), _params(model, guidance_scale_2=None), trained_steps=[0])


def test_negative_prompt_steers_guided_samples_and_is_ignored_at_scale_one(model_of):
    model = model_of("sd3")
    run = lambda **kw: sampler.generate(model, _requests(1), _params(model, **kw), trained_steps=[0])[0].latents  # noqa: E731
    assert not torch.equal(run(negative_prompt="blurry"), run(negative_prompt="sharp"))
    assert torch.equal(run(negative_prompt="blurry", guidance_scale=1.0), run(negative_prompt="sharp", guidance_scale=1.0))


def test_ltx_samples_unguided_with_cps_by_default(model_of):
    model = model_of("ltx")
    (t,) = sampler.generate(model, _requests(1), _params(model), trained_steps=[0, 1])
    assert t.sde_type == "cps" and t.cond.negative is None and t.guidance_scales == [1.0] * 4


def test_trained_steps_out_of_range_are_rejected(model_of):
    model = model_of("sd3")
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        sampler.generate(model, _requests(1), _params(model), trained_steps=[4])
