"""The reference-aligned choices observed through the trainer's real path: an in-process train
step of the tiny sd3 run (no Ray), the engine that samples it, and the weights pushed back."""

import pytest
import torch

NFT = "--loss-type nft --diffusion-sde-type ode --diffusion-step-strategy-path epoch_global_random_choice"


def _rank(tmp_path, extra):
    from dtype_helpers import engine_for, tiny_args

    from miles.backends.actor import TrainRank
    from miles.rollout.data import PromptDataset

    args, plan = tiny_args(tmp_path, extra)
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    return args, rank, engine_for(args), PromptDataset.from_args(args)


def test_nft_with_kl_beta_and_ema_computes_the_kl_and_samples_from_the_ramped_old_policy(tmp_path):
    from dtype_helpers import one_rollout

    from miles.backends.ema import old_policy_decay

    args, rank, engine, dataset = _rank(tmp_path, f"{NFT} --diffusion-kl-beta 0.1 --use-ema")
    assert args.ema_rollout_policy == "ema"  # DiffusionNFT's default under nft
    start = rank.trained_state()
    for rollout_id in range(2):
        metrics = rank.train(one_rollout(args, rollout_id, engine, dataset)).metrics
        assert metrics["train/kl_loss"] > 0 or rollout_id == 0  # the EMA starts equal to the weights
        assert "train/kl_loss" in metrics
        assert metrics["train/model_output_max_abs_diff"] == 0.0, (rollout_id, metrics)  # the engine sampled the old policy
        if rollout_id == 0:
            trained, old = rank.trained_state(), {}
            decay = old_policy_decay(rank.optimizer_step, init=0.0, ramp=0.001, maximum=0.5, flat_steps=0)
            assert decay == pytest.approx(0.002)  # two optimizer steps
            pushed = {f"{u.component}.{n}": t for u in rank.weight_updates() for n, t in u.state_dict.items()}
            bucketed = {f"{c}.{n}": t for c, n, t in rank.synced_tensors()}  # what --weight-sync bucketed sends
            assert all(torch.equal(bucketed[n], t) for n, t in pushed.items())
            for name, weights in trained.items():
                expected = start[name].lerp(weights, 1.0 - decay)
                assert torch.equal(pushed[name], expected), name
                old[name] = not torch.equal(pushed[name], weights)
            assert any(old.values())  # the engines get the old policy, not the trained weights
            for update in rank.weight_updates():
                engine.load_weights(update.component, update.state_dict)


def test_the_unconditional_cfg_branch_is_detached_unless_asked(tmp_path):
    from dtype_helpers import one_rollout

    from miles.flags.batching import Pair

    grads = {}
    for flag in ("", "--train-uncond-branch"):
        args, rank, engine, dataset = _rank(tmp_path / (flag or "detached"), "--debug-skip-optimizer-step " + flag)
        assert args.diffusion_guidance_scale > 1
        batch = one_rollout(args, 0, engine, dataset)
        sample = next(i for i, a in enumerate(batch.advantages) if a != 0)  # a pair the loss keeps
        loss, _ = rank._micro_batch_loss(batch, [Pair(sample, 0)], None, None)
        loss.backward()
        grads[flag] = torch.cat([p.grad.reshape(-1) for p in rank.fparams.values() if p.grad is not None])
    assert grads[""].abs().sum() > 0
    assert not torch.equal(grads[""], grads["--train-uncond-branch"])
