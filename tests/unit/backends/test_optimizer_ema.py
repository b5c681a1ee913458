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
    assert float(clip_gradients([p], 1.0)) == pytest.approx(5.0)
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


def test_ema_swap_exchanges_in_place_restoring_both_sides_bit_for_bit_with_one_reused_scratch():
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.nn.Parameter(torch.randn(5 + i, generator=g)) for i in range(3)}
    live = {n: p.detach().clone() for n, p in params.items()}
    ema = EMA(params, decay=0.5)
    for t in ema.shadow.values():
        t.mul_(3.0)
    shadow = {n: t.clone() for n, t in ema.shadow.items()}
    for _ in range(2):
        with ema.swapped_in(params):
            assert all(torch.equal(params[n], shadow[n]) for n in params)
        assert all(torch.equal(params[n], live[n]) and torch.equal(ema.shadow[n], shadow[n]) for n in params)
    # one scratch of the largest tensor, made by the first swap and reused: no copy of the model
    assert [t.numel() for t in ema._scratch.values()] == [7]


def test_foreach_adamw_on_two_shards_steps_every_element_as_foreach_false_on_the_whole_bit_for_bit():
    """The update is elementwise, so the shards one rank count makes (two halves here) and the
    single-tensor loop of foreach=False give the same bits."""
    from miles.backends.optimizer import build_optimizer

    class Args:
        lr, adam_beta1, adam_beta2, adam_eps, weight_decay = 1e-2, 0.9, 0.999, 1e-8, 0.01

    g = torch.Generator().manual_seed(1)
    start, grads = torch.randn(2, 37, generator=g), [torch.randn(2, 37, generator=g) for _ in range(3)]
    whole = torch.nn.Parameter(start.clone())
    halves = [torch.nn.Parameter(start[i].clone()) for i in range(2)]
    reference = torch.optim.AdamW([whole], lr=Args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                  foreach=False)
    sharded = build_optimizer(halves, Args)
    assert sharded.defaults["foreach"] is True
    for grad in grads:
        whole.grad, halves[0].grad, halves[1].grad = grad.clone(), grad[0].clone(), grad[1].clone()
        reference.step()
        sharded.step()
    assert torch.equal(torch.stack([h.detach() for h in halves]), whole.detach())
    assert not torch.equal(whole.detach(), start)


def test_one_parameter_group_per_block_steps_the_same_bits_as_one_group():
    """Groups bound foreach's temporaries by the largest block (miles.backends.optimizer); an
    elementwise update grouped any way gives the bits of a single group."""
    from miles.backends.optimizer import param_groups

    g = torch.Generator().manual_seed(2)
    names = ["transformer.pos_embed.proj.weight", "transformer.blocks.0.attn.weight", "transformer.blocks.0.ff.weight",
             "transformer.blocks.1.attn.weight", "transformer.proj_out.weight", "transformer.proj_out.bias"]
    sizes = [5, 7, 3, 20, 1, 4]
    one = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    split = [torch.nn.Parameter(p.detach().clone()) for p in one]
    groups = param_groups(list(zip(names, split)))
    assert [[p.numel() for p in grp["params"]] for grp in groups] == [[5], [7, 3], [20], [1, 4]]
    starts = [p.detach().clone() for p in one]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=True)
    a, b = torch.optim.AdamW(one, **kwargs), torch.optim.AdamW(groups, **kwargs)
    for _ in range(3):
        for p, q in zip(one, split):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(one, split))
    assert not torch.equal(one[0].detach(), starts[0])
