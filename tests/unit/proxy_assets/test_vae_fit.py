import json
import zlib

import pytest
import torch

from miles.proxy_assets.checkpoint import build_component
from miles.models.loader import load_model
from miles.models.registry import get_family
from miles.proxy_assets import FITTED_VAES
from miles.proxy_assets.vae_fit import deterministic_single_thread, synthetic_images

FITTED_FAMILIES = [f for f in ("sd3", "qwen_image", "wan2_2", "cosmos3", "ltx")
                   if get_family(f).module.components("tiny")["vae"].class_name in FITTED_VAES]


def _mean_colours(family: str, vae, latents: torch.Tensor) -> torch.Tensor:
    """Mean RGB of each latent's decode, [N, 3], through the family's own decode (its scaling)."""
    with torch.no_grad():
        images = torch.cat([get_family(family).module.decode({"vae": vae}, z[None]) for z in latents])
    return images.flatten(0, 1).mean(dim=(-2, -1)) if images.dim() == 5 else images.mean(dim=(-2, -1))


def _latents(shape: tuple[int, ...], n: int = 8) -> torch.Tensor:
    """Unit-scale noise plus a per-sample, per-channel offset, as a policy could shift it."""
    g = torch.Generator().manual_seed(7)
    offset = torch.randn((n, shape[0]) + (1,) * (len(shape) - 1), generator=g)
    return torch.randn((n,) + shape, generator=g) + offset


def _spread(colours: torch.Tensor) -> float:
    """Largest per-channel range of mean colour across the decodes."""
    return float((colours.max(dim=0).values - colours.min(dim=0).values).max())


@pytest.mark.parametrize("family", FITTED_FAMILIES)
def test_fitted_tiny_vae_decodes_different_latents_to_clearly_different_colours(family, tiny_checkpoint):
    model = load_model(tiny_checkpoint(family), family=family)
    colours = _mean_colours(family, model.vae, _latents(model.latent_shape(64, 64, 1)))
    assert _spread(colours) > 0.3, colours


def test_an_unfitted_vae_fails_the_same_check():
    spec = get_family("sd3").module.components("tiny")["vae"]
    vae = build_component(spec, seed=(0 * 1_000_003 + zlib.crc32(b"vae")) % 2**63)
    colours = _mean_colours("sd3", vae, _latents((4, 8, 8)))
    assert _spread(colours) < 0.1, colours


def test_fitted_latent_scaling_gives_unit_scale_latents(tiny_checkpoint):
    vae = load_model(tiny_checkpoint("sd3"), family="sd3").vae
    images = synthetic_images(16, 32, torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = vae.encode(images).latent_dist.mean
    latents = (z - vae.config.shift_factor) * vae.config.scaling_factor
    assert 0.5 < float(latents.std()) < 2.0
    assert abs(float(latents.mean())) < 0.5


def test_synthetic_images_are_seeded_and_in_range():
    a = synthetic_images(6, 16, torch.Generator().manual_seed(3))
    b = synthetic_images(6, 16, torch.Generator().manual_seed(3))
    c = synthetic_images(6, 16, torch.Generator().manual_seed(4))
    assert a.shape == (6, 3, 16, 16) and torch.equal(a, b) and not torch.equal(a, c)
    assert float(a.min()) >= -1.0 and float(a.max()) <= 1.0
    assert float(a.mean(dim=(2, 3)).std()) > 0.2  # the images differ in mean colour


def test_the_fit_context_restores_threads_and_determinism():
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    state = torch.get_rng_state()
    with deterministic_single_thread():
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
        torch.rand(3)
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic
    assert torch.equal(torch.get_rng_state(), state)


def test_ensure_checkpoint_rebuilds_a_tiny_checkpoint_cached_before_the_fit(tmp_path, monkeypatch):
    from miles.proxy_assets import checkpoint as cc

    built = []

    def fake_create(family, size, seed, out, overwrite=False):
        out.mkdir(parents=True, exist_ok=True)
        marker = cc.vae_fit_marker(family, size)
        index = {"vae": ["diffusers", "AutoencoderKL"]}  # as a real build records its VAE
        (out / "model_index.json").write_text(json.dumps(index if marker is None else {**index, "_miles_vae_fit": marker}))
        (out / "vae").mkdir(exist_ok=True)  # complete, as a real build leaves it: a config and weights
        (out / "vae" / "config.json").write_text("{}")
        (out / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
        built.append(family)
        return out

    monkeypatch.setattr(cc, "create_checkpoint", fake_create)
    stale = tmp_path / cc.checkpoint_name("sd3", "tiny", 0)
    stale.mkdir()
    (stale / "model_index.json").write_text("{}")  # what the random-VAE builds wrote
    cc.ensure_checkpoint("sd3", "tiny", 0, tmp_path)
    cc.ensure_checkpoint("sd3", "tiny", 0, tmp_path)
    assert built == ["sd3"]
    assert cc.vae_fit_marker("sd3", "tiny") is not None and cc.vae_fit_marker("sd3", "proxy") is None


def test_fitted_tiny_ltx2_vae_decodes_different_joint_states_to_clearly_different_colours(tiny_checkpoint):
    """ltx2's state holds the video tokens beside the audio ones ([f, h, w + r, C]): offsets per latent
    channel (the last axis) move the decoded frames' colours as they do for the other families."""
    model = load_model(tiny_checkpoint("ltx2"), family="ltx2")
    shape = model.latent_shape(64, 64, 9)
    g = torch.Generator().manual_seed(7)
    latents = torch.stack([torch.randn(shape, generator=g) + torch.randn(shape[-1], generator=g) for _ in range(8)])
    with torch.no_grad():
        colours = model.decode(latents).mean(dim=(1, 3, 4))  # [8, 3]: each sample's mean RGB over its frames
    assert _spread(colours) > 0.3, colours
