"""Loss math against values worked out by hand."""

import math

import pytest
import torch

from miles.backends.loss import (
    NFTInputs,
    PolicyLossInputs,
    compute_advantages,
    gaussian_mean_kl,
    load_custom_loss,
    nft_loss,
    nft_optimality,
    policy_loss,
    sft_loss,
    trained_pairs_mask,
)

EPS = 1e-4  # Flow-GRPO's std guard


def test_advantages_are_normalised_within_each_prompt_group():
    adv = compute_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2)
    # group (1, 3): mean 2, population std 1; group (2, 2): no spread, so zero advantage
    assert torch.allclose(adv, torch.tensor([-1 / (1 + EPS), 1 / (1 + EPS), 0.0, 0.0]))


def test_advantages_globalized_use_batch_mean_and_std():
    adv = compute_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2, globalize_mean=True, globalize_std=True)
    std = math.sqrt(0.5)
    assert torch.allclose(adv, torch.tensor([-1, 1, 0, 0]) / (std + EPS))


def test_advantages_global_mean_with_group_std():
    adv = compute_advantages(torch.tensor([0.0, 2.0, 4.0, 4.0]), 2, globalize_mean=True)
    # batch mean 2.5; group stds 1 and 0
    assert torch.allclose(adv, torch.tensor([-2.5 / (1 + EPS), -0.5 / (1 + EPS), 1.5 / EPS, 1.5 / EPS]).clamp(-5, 5))


def test_advantages_single_sample_per_prompt_are_normalised_over_the_batch():
    # flow_grpo's untracked branch: (r - batch mean) / (batch std + 1e-4), whatever the globalize flags say
    expected = torch.tensor([-1.0, 1.0]) / (1 + EPS)
    for flags in ({}, {"globalize_mean": True}, {"globalize_std": True}, {"globalize_mean": True, "globalize_std": True}):
        assert torch.allclose(compute_advantages(torch.tensor([1.0, 3.0]), 1, **flags), expected)
    assert torch.allclose(compute_advantages(torch.tensor([0.0, 4.0]), 1), torch.tensor([-2.0, 2.0]) / (2 + EPS))


def test_zero_advantage_pairs_leave_the_policy_loss_unless_kept():
    adv = compute_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2)  # second group flat
    keep = trained_pairs_mask(adv, keep_zero_advantage=False)
    assert keep.tolist() == [True, True, False, False]
    assert trained_pairs_mask(adv, keep_zero_advantage=True).all()
    inputs = _inputs([0.0] * 4, [0.0] * 4, adv.tolist())
    inputs.keep = keep
    dropped, _ = policy_loss(inputs, clip_range=0.05)
    inputs.keep = None
    kept, _ = policy_loss(inputs, clip_range=0.05)
    # ratio 1: per pair -A; the flat pairs add 0 but halve the mean when kept
    assert dropped.item() == pytest.approx(0.0, abs=1e-7) and kept.item() == pytest.approx(0.0, abs=1e-7)
    inputs = _inputs([0.1] * 4, [0.0] * 4, adv.tolist())
    inputs.keep = keep
    assert policy_loss(inputs, clip_range=0.5)[0].item() == pytest.approx(
        2 * policy_loss(_inputs([0.1] * 4, [0.0] * 4, adv.tolist()), clip_range=0.5)[0].item(), rel=1e-6)


def test_advantages_are_clamped():
    adv = compute_advantages(torch.tensor([1.0, 3.0]), 2, adv_clip_max=0.5)
    assert torch.equal(adv, torch.tensor([-0.5, 0.5]))


def _inputs(new, old, adv, **kw):
    b = len(new)
    return PolicyLossInputs(
        log_prob=torch.tensor(new, requires_grad=True), old_log_prob=torch.tensor(old),
        advantages=torch.tensor(adv), mean=kw.get("mean", torch.zeros(b, 2)),
        std=kw.get("std", torch.ones(b, 1)), ref_mean=kw.get("ref_mean"), std_dev_t=kw.get("std_dev_t"),
    )


def test_policy_loss_clips_the_ratio_on_the_side_that_helps():
    inputs = _inputs([0.1, 0.0], [0.0, 0.0], [1.0, -1.0])
    loss, metrics = policy_loss(inputs, clip_range=0.05)
    # pair 0: ratio e^0.1 = 1.105, A = 1: max(-1.105, -1.05) = -1.05; pair 1: ratio 1, A = -1: 1
    assert loss.item() == pytest.approx((-1.05 + 1.0) / 2, abs=1e-6)
    assert metrics["ppo_clipfrac"].item() == 0.5
    loss.backward()
    # the clipped pair passes no gradient; the other: d/dlogp (-A e^(logp - old)) / 2 = 0.5
    assert torch.allclose(inputs.log_prob.grad, torch.tensor([0.0, 0.5]))


def test_policy_loss_keeps_the_unclipped_term_when_it_is_worse():
    inputs = _inputs([0.1], [0.0], [-1.0])
    loss, _ = policy_loss(inputs, clip_range=0.05)
    assert loss.item() == pytest.approx(math.exp(0.1), abs=1e-6)  # max(1.105, 1.05)


def test_policy_loss_adds_the_kl_to_the_reference():
    inputs = _inputs([0.0], [0.0], [0.0], mean=torch.tensor([[1.0, 2.0]]),
                     ref_mean=torch.zeros(1, 2), std=torch.tensor([[0.1]]), std_dev_t=torch.tensor([[0.5]]))
    inputs.keep = torch.tensor([True])
    loss, metrics = policy_loss(inputs, clip_range=0.05, kl_beta=0.1)
    # mean((1, 4)) / (2 * 0.25) = 5: over std_dev_t, not the step's std
    assert metrics["kl_loss"].item() == pytest.approx(5.0)
    assert loss.item() == pytest.approx(0.5)


def test_policy_loss_with_kl_needs_a_reference():
    with pytest.raises(ValueError, match="reference"):
        policy_loss(_inputs([0.0], [0.0], [0.0]), clip_range=0.05, kl_beta=0.1)


def test_gaussian_mean_kl_is_per_pair_with_its_own_std():
    kl = gaussian_mean_kl(torch.tensor([[1.0], [1.0]]), torch.zeros(2, 1), torch.tensor([[1.0], [0.5]]))
    assert kl.tolist() == pytest.approx([0.5, 2.0])


def test_nft_loss_pulls_the_positive_policy_on_good_and_the_negative_on_bad_samples():
    # x_t = 0, t = 1, x0 = 0: x0_hat = -v, so |x0_hat - x0|^2 / |x0_hat - x0| = |v|
    def loss(advantage, adaptive=True):
        inputs = NFTInputs(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.zeros(1, 1), torch.zeros(1, 1),
                           torch.tensor([1.0]), torch.tensor([advantage]))
        return nft_loss(inputs, beta=0.5, adv_clip_max=5.0, adaptive_weight=adaptive)[0].item()
    assert loss(5.0) == pytest.approx(5.0 * 1.5 / 0.5)  # r = 1: v+ = 0.5 * 1 + 0.5 * 2
    assert loss(-5.0) == pytest.approx(5.0 * 0.5 / 0.5)  # r = 0: v- = 1.5 * 1 - 0.5 * 2
    assert loss(5.0, adaptive=False) == pytest.approx(5.0 * 1.5**2 / 0.5)


def test_nft_loss_adds_the_kl_to_the_reference_velocity():
    inputs = NFTInputs(torch.tensor([[2.0, 0.0]]), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2),
                       torch.tensor([0.5]), torch.tensor([0.0]), v_ref=torch.zeros(1, 2))
    without, _ = nft_loss(inputs, beta=1.0, adv_clip_max=5.0)
    with_kl, metrics = nft_loss(inputs, beta=1.0, adv_clip_max=5.0, kl_beta=0.1)
    assert metrics["kl_loss"].item() == pytest.approx(2.0)  # mean((4, 0))
    assert with_kl.item() == pytest.approx(without.item() + 0.2)


def test_nft_optimality_maps_clamped_advantage_to_unit_interval():
    r = nft_optimality(torch.tensor([-10.0, -2.5, 0.0, 5.0]), adv_clip_max=5.0)
    assert torch.equal(r, torch.tensor([0.0, 0.25, 0.5, 1.0]))


def test_sft_loss_regresses_the_flow_matching_velocity():
    loss, _ = sft_loss(torch.tensor([[1.0, 1.0]]), x0=torch.tensor([[1.0, 0.0]]), noise=torch.zeros(1, 2))
    assert loss.item() == pytest.approx((4 + 1) / 2)  # target e - x0 = (-1, 0)


def test_custom_loss_loads_from_both_path_forms():
    assert load_custom_loss("math:sqrt").__wrapped__ is math.sqrt
    assert load_custom_loss("math.sqrt").__wrapped__ is math.sqrt
    with pytest.raises(ValueError, match="has no function .pi."):
        load_custom_loss("math:pi")


def test_a_custom_loss_that_returns_a_float_or_raises_names_the_path_and_what_it_must_return():
    from miles.utils.dotted_path import CustomFunctionError

    with pytest.raises(CustomFunctionError, match=r"math:sqrt returned a float; fix: return \(loss, metrics\)"):
        load_custom_loss("math:sqrt")(4.0)
    with pytest.raises(CustomFunctionError, match=r"math:sqrt raised ValueError: .*must return \(loss, metrics\)"):
        load_custom_loss("math:sqrt")(-1.0)
