"""The SDE/ODE/CPS step against numbers worked out by hand from DESIGN section 5."""

import math
import os
import pickle

import pytest
import torch

from miles.rollout.sde import SDE_TYPES, largest_sigma_below_one, ode_step, sde_step, sde_step_on_host
from miles.rollout.types import Conditioning, Trajectory


def _one(value):
    return torch.full((1, 1, 1, 1), value)


def test_sde_step_matches_hand_computed_mean_std_and_log_prob():
    x, v, s, s_next, a, e = 0.5, -0.2, 0.6, 0.4, 0.7, 0.3
    std_t = a * math.sqrt(s / (1 - s))
    dt = s_next - s
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * math.sqrt(-dt)
    x_next = mean + std * e
    logp = -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))

    r = sde_step(_one(x), _one(v), s, s_next, a, "sde", noise=_one(e))
    assert r.mean.item() == pytest.approx(mean, rel=1e-6)
    assert r.std.item() == pytest.approx(std, rel=1e-6)
    assert r.x_next.item() == pytest.approx(x_next, rel=1e-6)
    assert r.log_prob.item() == pytest.approx(logp, abs=1e-6)


def test_sde_step_at_sigma_one_uses_largest_sigma_below_one_in_the_denominator():
    sigmas = [1.0, 0.9, 0.5, 0.0]
    s_max = largest_sigma_below_one(sigmas)
    assert s_max == 0.9
    a, dt = 0.7, 0.9 - 1.0
    std_t = a * math.sqrt(1.0 / (1 - s_max))
    mean = 0.5 * (1 + std_t**2 / 2 * dt) + 0.1 * dt  # (1 - s) term vanishes at s = 1
    r = sde_step(_one(0.5), _one(0.1), 1.0, 0.9, a, "sde", noise=_one(0.0), sigma_max=s_max)
    assert r.mean.item() == pytest.approx(mean, rel=1e-6)
    assert r.std.item() == pytest.approx(std_t * math.sqrt(-dt), rel=1e-6)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step(_one(0.5), _one(0.1), 1.0, 0.9, a, "sde")


def test_log_prob_is_averaged_over_non_batch_dims():
    x = torch.zeros(2, 3, 4, 4)
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    r = sde_step(x, torch.zeros_like(x), 0.5, 0.25, 0.7, "sde", noise=noise)
    std = r.std.flatten()[0].item()
    expected = (-(noise * std) ** 2 / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    assert r.log_prob.shape == (2,)
    torch.testing.assert_close(r.log_prob, expected.float())


def test_ode_step_is_euler_and_ignores_noise():
    r = sde_step(_one(0.5), _one(-0.2), 0.6, 0.4, 0.7, "ode", noise=_one(10.0))
    assert r.x_next.item() == pytest.approx(0.5 + -0.2 * (0.4 - 0.6))
    assert r.log_prob.item() == 0.0


def test_the_unrecorded_ode_step_equals_the_recorded_one_bit_for_bit():
    """The sampler's untrained steps go through `ode_step`; the trainer and the stored latents know
    `sde_step`'s ode. Both are one fp32 multiply and one add per element with the same fp32 dt,
    each exactly rounded, so equal bits are required on any CPU."""
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    for sigma, sigma_next in [(1.0, 0.93), (0.6172, 0.4011), (0.1, 0.0)]:
        assert torch.equal(ode_step(x, v, sigma, sigma_next), sde_step(x, v, sigma, sigma_next, 0.7, "ode").x_next)


def test_cps_step_matches_hand_computed_values():
    x, v, s, s_next, a, e = 0.5, -0.2, 0.6, 0.4, 0.7, 0.3
    std = s_next * math.sin(a * math.pi / 2)
    x0 = x - s * v
    eps = x + (1 - s) * v
    mean = x0 * (1 - s_next) + eps * math.sqrt(s_next**2 - std**2)
    r = sde_step(_one(x), _one(v), s, s_next, a, "cps", noise=_one(e))
    assert r.mean.item() == pytest.approx(mean, rel=1e-6)
    assert r.x_next.item() == pytest.approx(mean + std * e, rel=1e-6)
    assert r.log_prob.item() == pytest.approx(-((std * e) ** 2), rel=1e-5)


def test_log_prob_of_a_given_x_next_equals_the_generating_step_exactly():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    for kind in ("sde", "cps"):
        fwd = sde_step(x, v, 0.7, 0.5, 0.7, kind, noise=torch.randn(3, 4, 8, 8, generator=g))
        again = sde_step(x, v, 0.7, 0.5, 0.7, kind, x_next=fwd.x_next)
        assert torch.equal(fwd.log_prob, again.log_prob)
        assert torch.equal(fwd.x_next, again.x_next)


def test_gradient_flows_through_the_mean_not_the_stored_sample():
    x = torch.randn(1, 2, 4, 4)
    v = torch.randn(1, 2, 4, 4, requires_grad=True)
    r = sde_step(x, v, 0.7, 0.5, 0.7, "sde", x_next=torch.randn(1, 2, 4, 4))
    r.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_step_is_computed_in_fp32():
    x = torch.randn(1, 2, 4, 4, dtype=torch.bfloat16)
    r = sde_step(x, x, 0.7, 0.5, 0.7, "sde")
    assert r.x_next.dtype == r.log_prob.dtype == torch.float32


def test_unknown_sde_type_is_rejected():
    with pytest.raises(ValueError, match="unknown sde_type"):
        sde_step(_one(0.0), _one(0.0), 0.5, 0.4, 0.7, "ddim")


def test_trajectory_and_conditioning_pickle_round_trip():
    cond = Conditioning({"encoder_hidden_states": torch.randn(2, 3, 4)}, {"encoder_hidden_states": torch.zeros(2, 3, 4)})
    one = cond.select(1)
    assert one.batch_size == 1 and torch.equal(Conditioning.cat([cond.select(0), one]).positive["encoder_hidden_states"], cond.positive["encoder_hidden_states"])
    t = Trajectory("p", 0, 1, 7, torch.zeros(3, 4, 2, 2), torch.tensor([1.0, 0.5, 0.0]), torch.zeros(2), [0],
                   one, ["transformer"] * 2, [4.0, 4.0], "sde", 0.7, torch.zeros(3, 8, 8))
    back = pickle.loads(pickle.dumps(t))
    assert torch.equal(back.cond.positive["encoder_hidden_states"], one.positive["encoder_hidden_states"])
    assert back.num_steps == 2


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_a_samples_log_prob_does_not_depend_on_the_batch_it_is_computed_in(sde_type):
    # The engine scores a sample inside its sampling batch, the trainer inside a micro-batch of
    # another size; parity needs the same bits. On a GPU a batched reduction's order depends on
    # the batch (6e-8 apart on an H200): ci/gpu_check.sh runs this with MILES_TEST_DEVICE=cuda.
    device = os.environ.get("MILES_TEST_DEVICE", "cpu")
    gen = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(16, 16, 2, 64, 64, generator=gen).to(device) for _ in range(3))
    sigma = torch.rand(16, generator=gen).to(device) * 0.5 + 0.4
    sigma_next = sigma - 0.1
    whole = sde_step(x, v, sigma, sigma_next, 0.7, sde_type, noise=noise)
    for size in (1, 3, 8):
        part = sde_step(x[:size], v[:size], sigma[:size], sigma_next[:size], 0.7, sde_type,
                        x_next=whole.x_next[:size])
        assert torch.equal(part.log_prob, whole.log_prob[:size]), (size, part.log_prob - whole.log_prob[:size])


def test_the_sampler_and_the_trainer_step_through_the_host_step():
    # parity needs both sides to step on one device (sde_step_on_host): the engine in
    # sampler._denoise and the trainer in TrainRank._step must both call it
    import miles.backends.train_step as actor
    import miles.rollout.sampler as sampler
    from miles.rollout import sde

    for module in (actor, sampler):
        assert module.sde_step_on_host is sde.sde_step_on_host
        assert "sde_step" not in vars(module), f"{module.__name__} steps without sde_step_on_host"


def test_the_host_step_equals_the_cpu_step_and_returns_on_the_models_device():
    # with MILES_TEST_DEVICE=cuda (ci/gpu_check.sh) the model output is on the GPU, as in a trainer
    device = os.environ.get("MILES_TEST_DEVICE", "cpu")
    gen = torch.Generator().manual_seed(3)
    x, v, x_next = (torch.randn(4, 3, 8, 8, generator=gen) for _ in range(3))
    sigma, sigma_next = torch.full((4,), 0.8), torch.full((4,), 0.7)
    on_cpu = sde_step(x, v, sigma, sigma_next, 0.7, "sde", x_next=x_next)
    v_model = v.to(device).requires_grad_(True)
    hosted = sde_step_on_host(x.to(device), v_model, sigma.to(device), sigma_next.to(device), 0.7, "sde",
                              x_next=x_next.to(device))
    assert hosted.log_prob.device == v_model.device and hosted.mean.device == v_model.device
    assert torch.equal(hosted.log_prob.cpu(), on_cpu.log_prob)  # the engine's bits, wherever the model runs
    hosted.log_prob.sum().backward()
    assert v_model.grad is not None and v_model.grad.abs().sum() > 0
