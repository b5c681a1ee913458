import os

import pytest
import torch

from miles.proxy_assets.checkpoint import ensure_checkpoint
from miles.models.loader import load_model
from miles.models.runtime import configure_torch
from miles.rollout import sampler
from miles.rollout.sde import largest_sigma_below_one, sde_step
from miles.rollout.types import SampleRequest, SamplingParams
from miles.utils.families import FAMILY_NAMES

PARAMS = dict(num_steps=4, height=32, width=32, guidance_scale=4.0, guidance_scale_2=3.0, negative_prompt="blurry")


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    configure_torch(num_threads=1)
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "miles-tiny-checkpoints"
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_model(ensure_checkpoint(family, "tiny", 0, root))
        return cache[family]

    return get


def _requests(n=4, groups=2, seed=10):
    return [SampleRequest(f"prompt number {i % groups}", i % groups, i // groups, seed + i, {"k": i}) for i in range(n)]


def _params(model, **overrides):
    frames = 5 if model.spec.is_video else 1
    return SamplingParams(**{**PARAMS, "num_frames": frames, **overrides})


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_log_probs_and_outputs_recomputed_outside_the_engine_equal_the_engines(family, model_of):
    model = model_of(family)
    trajectories = sampler.generate(model, _requests(), _params(model), trained_steps=[0, 1, 2], debug=True)
    for t in trajectories:
        sigmas = t.sigmas.tolist()
        for k in range(t.num_steps):
            x = t.latents[k : k + 1]
            with torch.enable_grad():  # the trainer's recomputation
                v = model.velocity(x, sigmas[k], t.cond, t.guidance_scales[k], t.experts[k])
            kind = t.sde_type if k in t.trained_steps else "ode"
            step = sde_step(x, v, sigmas[k], sigmas[k + 1], t.noise_level, kind,
                            x_next=t.latents[k + 1 : k + 2], sigma_max=largest_sigma_below_one(sigmas))
            assert torch.equal(v.detach()[0], t.model_outputs[k])
            assert torch.equal(step.log_prob.detach()[0], t.log_probs[k])
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


def test_rollout_is_reproducible_whatever_the_microgroups_or_order(model_of):
    model = model_of("sd3")
    reqs = _requests(4)
    a = sampler.generate(model, reqs, _params(model, microgroup_size=1), trained_steps=[0, 1])
    b = sampler.generate(model, reqs[::-1], _params(model, microgroup_size=None), trained_steps=[0, 1])[::-1]
    for x, y in zip(a, b):
        assert torch.equal(x.latents, y.latents) and torch.equal(x.log_probs, y.log_probs)
        assert torch.equal(x.image, y.image)
    assert not torch.equal(a[0].latents, a[2].latents)  # same prompt, different seed


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
