"""--gradient-checkpointing: enabled through diffusers on every family, the same gradients, or an error."""

from __future__ import annotations

import pytest
import torch

from miles.backends.actor import enable_gradient_checkpointing
from miles.diffusion_facts.families import FAMILY_NAMES


def _grads(tmp_path, batch, extra: str):
    from dtype_helpers import tiny_args

    from miles.backends.actor import TrainRank
    from miles.flags.batching import Pair

    args, plan = tiny_args(tmp_path, extra)
    rank = TrainRank(args, plan, 0, 1)
    rank.setup()
    loss, _ = rank._micro_batch_loss(batch, [Pair(0, 0), Pair(1, 1)], None, None)
    loss.backward()
    modules = [rank.fmodel.transformers[c] for c in rank.components]
    return {n: p.grad.clone() for n, p in rank.fparams.items()}, modules


def test_gradients_are_equal_with_and_without_checkpointing(tmp_path):
    """Bit-equal: checkpointing re-runs the same forward ops on the same CPU thread, and nothing in
    the tiny transformers is random (no dropout), so the recomputed activations are the same bits."""
    from dtype_helpers import one_rollout, tiny_args

    batch = one_rollout(tiny_args(tmp_path)[0], 0)
    plain, plain_modules = _grads(tmp_path, batch, "")
    checkpointed, modules = _grads(tmp_path, batch, "--gradient-checkpointing")
    assert all(m.gradient_checkpointing for m in modules) and not any(m.gradient_checkpointing for m in plain_modules)
    assert plain.keys() == checkpointed.keys()
    assert any(float(g.abs().max()) > 0 for g in plain.values())
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_enables_it_through_the_diffusers_api(family):
    from miles.proxy_assets.checkpoint import build_component
    from miles.models.registry import get_family

    spec = get_family(family)
    components = spec.module.components("tiny")
    for name in spec.transformer_components:
        module = build_component(components[name], 0)
        enable_gradient_checkpointing(module, family, name)
        assert module.is_gradient_checkpointing


def test_a_transformer_without_it_is_refused_naming_the_family():
    with pytest.raises(ValueError, match="--gradient-checkpointing: the sd3 family's transformer .Linear. does not "
                                         "support gradient checkpointing; drop the flag"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), "sd3", "transformer")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_familys_transformer_gradients_are_equal_with_and_without_checkpointing(family):
    """Every expert of every family, through the model's own velocity call (conditioning, guidance
    off); bit-equal for the reason above."""
    from dtype_helpers import assets_dir

    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.models.loader import load_model

    model = load_model(ensure_checkpoint(family, "tiny", 0, assets_dir()))
    frames = 5 if model.spec.is_video else 1
    x = torch.randn(1, *model.latent_shape(32, 32, frames), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cat"], None)

    def grads(name):
        """The gradients, and how often the first block started a forward: twice when backward
        recomputes it (a pre-hook: the recomputation stops once it has what backward needs, before
        the block's own forward hooks would run)."""
        module = model.transformers[name]
        blocks = getattr(module, "transformer_blocks", None) or module.blocks
        calls = []
        hook = blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
        module.requires_grad_(True)
        module.zero_grad(set_to_none=True)
        model.velocity(x, 0.7, cond, 1.0, name).pow(2).mean().backward()
        hook.remove()
        return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, len(calls)

    for name in model.spec.transformer_components:
        plain, plain_runs = grads(name)
        enable_gradient_checkpointing(model.transformers[name], family, name)
        checkpointed, runs = grads(name)
        assert (plain_runs, runs) == (1, 2), f"{family} {name}: the first block ran {plain_runs} / {runs} times"
        assert plain and plain.keys() == checkpointed.keys(), (family, name)
        assert any(float(g.abs().max()) > 0 for g in plain.values())
        for param in plain:
            assert torch.equal(plain[param], checkpointed[param]), (family, name, param)
