"""A rank's background checkpoint write (miles.backends.checkpoint_writer): what it writes is the
state of the moment the save began, even when training steps on while it writes."""

from __future__ import annotations

import threading

import torch

from dtype_helpers import engine_for, one_rollout, tiny_args
from miles.backends import checkpoint as ckpt
from miles.backends.actor import TrainRank


def test_a_background_save_writes_the_state_of_the_moment_it_began_while_training_goes_on(tmp_path, monkeypatch):
    args, plan = tiny_args(tmp_path / "run", "--use-ema --ema-decay 0.5")
    batch = one_rollout(args, 0, engine_for(args))
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    rank.train(batch)
    began = rank.trained_state()
    shadow = {n: t.clone() for n, t in rank.ema.shadow.items()}
    step, moments = rank.optimizer_step, ckpt_moments(rank.optimizer.state_dict())
    staging = tmp_path / "ckpt"
    staging.mkdir()
    trained = threading.Event()  # the writer writes only after the next step: a copy not taken shows
    write = ckpt.save_tensors
    monkeypatch.setattr(ckpt, "save_tensors", lambda path, tensors: (trained.wait(60), write(path, tensors)))
    rank.begin_save(str(staging))
    assert not rank.save_done()
    rank.train(batch)  # steps the weights, the EMA and the optimizer in place during the write
    trained.set()
    assert max(float((rank.trained_state()[n] - t).abs().max()) for n, t in began.items()) > 0.0
    rank.finish_save()
    saved = ckpt.load_tensors(staging / "model_transformer.safetensors")
    assert all(torch.equal(saved[n.split(".", 1)[1]], t) for n, t in began.items())
    saved_ema = ckpt.load_tensors(staging / "ema_transformer.safetensors")
    assert all(torch.equal(saved_ema[n.split(".", 1)[1]], t) for n, t in shadow.items())
    saved_optimizer = torch.load(staging / "optimizer.pt", weights_only=False)
    assert saved_optimizer["optimizer_step"] == step
    assert all(torch.equal(a, b) for a, b in zip(ckpt_moments(saved_optimizer["optimizer"]), moments))


def ckpt_moments(state: dict) -> list[torch.Tensor]:
    """Every AdamW moment in the state dict, copied, in a fixed order."""
    return [t.clone() for _, per in sorted(state["state"].items()) for _, t in sorted(per.items())
            if isinstance(t, torch.Tensor) and t.dim() > 0]
