import pytest
import torch

from miles.backends.ema import EMA
from miles.backends.optimizer import clip_gradients, learning_rate


def lr(step, style, warmup=0, total=12):
    return learning_rate(step, lr=1.0, min_lr=0.0, warmup_steps=warmup, total_steps=total, decay_style=style)


def test_warmup_is_linear_then_reaches_the_peak():
    assert [lr(s, "constant", warmup=2) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_linear_and_cosine_decay_hit_half_way_and_the_floor():
    assert lr(7, "linear", warmup=2) == pytest.approx(0.5)
    assert lr(7, "cosine", warmup=2) == pytest.approx(0.5)
    assert lr(12, "cosine", warmup=2) == pytest.approx(0.0)
    assert lr(3, "cosine", warmup=2) > lr(4, "cosine", warmup=2)


def test_unknown_decay_style_is_rejected():
    with pytest.raises(ValueError, match="lr-decay-style"):
        lr(0, "step")


def test_gradient_clipping_returns_the_norm_before_clipping():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_gradients([p], 1.0) == pytest.approx(5.0)
    # clip_grad_norm_ scales by max_norm / (norm + 1e-6); the fp32 norm of (3, 4) is exactly 5, and the
    # coefficient and each product round once (half an ulp of a value below 1 each)
    want = torch.tensor([3.0, 4.0], dtype=torch.float64) / (5 + 1e-6)
    assert float((p.grad.double() - want).abs().max()) <= 2 * 2.0 ** -24


def test_ema_moves_a_decay_fraction_toward_the_weights():
    p = torch.nn.Parameter(torch.zeros(1))
    ema = EMA({"w": p}, decay=0.9)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update({"w": p})
    ema.update({"w": p})
    assert ema.shadow["w"].item() == pytest.approx(0.19)


def test_ema_swap_restores_the_live_weights():
    p = torch.nn.Parameter(torch.ones(1))
    ema = EMA({"w": p}, decay=0.5)
    ema.shadow["w"].fill_(7.0)
    with ema.swapped_in({"w": p}):
        assert p.item() == 7.0
    assert p.item() == 1.0
