"""Fit a tiny checkpoint's VAE into a real (small) autoencoder of simple synthetic images.

A randomly initialised diffusers VAE decodes every latent to nearly the same mean colour: its
GroupNorm layers remove the latent's spatial mean and the random decoder carries little else. A
reward on colour or brightness then cannot move with the policy. `fit_vae` trains the VAE for
250 small steps (a few seconds on one core) on images generated in code from the seed (flat
colours, two-colour gradients, up to two rectangles or discs on them), then sets the family's latent normalisation (scaling/shift
factor, or per-channel latents mean/std) from the fitted latents, so latents of unit scale, as the
sampler draws them, decode to varied images.

Deterministic: one CPU thread (restored afterwards), deterministic algorithms, fixed seeds and a
fixed data order; the global RNG state is left as it was. The same VAE and seed give the same bytes.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# VAEs whose encode/decode take videos [B, C, F, H, W]; images are fitted as one-frame videos
VIDEO_VAES = ("AutoencoderKLQwenImage", "AutoencoderKLWan", "AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video")
SUPPORTED_VAES = ("AutoencoderKL",) + VIDEO_VAES  # what fit_vae can fit


@dataclass(frozen=True)
class FitSettings:
    decoder_steps: int = 150  # stage 1: the decoder learns to decode a fixed colour code
    encoder_steps: int = 100  # stage 2: the encoder learns to write that code
    batch_size: int = 8
    image_size: int = 32
    lr: float = 5e-3
    code_scale: float = 2.0  # length of the code's colour directions, in latent units
    posterior_std: float = 1.0  # fixed posterior std: decoders see noisy latents, as samplers make
    coarse_weight: float = 4.0  # weight of the reconstruction error of each latent cell's mean colour
    stats_images: int = 64  # images whose latents set the normalisation


DEFAULT_SETTINGS = FitSettings()


@contextlib.contextmanager
def deterministic_single_thread():
    """One intra-op thread and deterministic kernels inside; the caller's settings after."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_num_threads(threads)


# -- data ---------------------------------------------------------------------------------------


def _colors(n: int, generator: torch.Generator) -> torch.Tensor:
    """[n, 3] in [0, 1]; each channel is 0, 1 or uniform, so saturated colours are common."""
    uniform = torch.rand(n, 3, generator=generator)
    corner = torch.randint(0, 2, (n, 3), generator=generator).float()
    pick_corner = torch.rand(n, 3, generator=generator) < 0.5
    return torch.where(pick_corner, corner, uniform)


def synthetic_images(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """[n, 3, size, size] in [-1, 1]: a flat or gradient background with 0-2 shapes on it."""
    axis = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    v, u = torch.meshgrid(axis, axis, indexing="ij")  # [size, size], rows then columns
    u, v = u.view(1, 1, size, size), v.view(1, 1, size, size)

    first, second = _colors(n, generator), _colors(n, generator)
    angle = torch.rand(n, generator=generator) * 2 * math.pi
    along = (u - 0.5) * angle.cos().view(n, 1, 1, 1) + (v - 0.5) * angle.sin().view(n, 1, 1, 1)
    ramp = (along * math.sqrt(2) + 0.5).clamp(0, 1)
    is_gradient = (torch.rand(n, generator=generator) < 0.4).view(n, 1, 1, 1).float()
    ramp = ramp * is_gradient  # flat backgrounds keep the first colour everywhere
    images = first.view(n, 3, 1, 1) * (1 - ramp) + second.view(n, 3, 1, 1) * ramp

    num_shapes = torch.randint(0, 3, (n,), generator=generator)
    for k in range(2):
        color = _colors(n, generator).view(n, 3, 1, 1)
        center = torch.rand(n, 2, generator=generator)
        half = 0.08 + 0.25 * torch.rand(n, 2, generator=generator)
        is_disc = torch.rand(n, generator=generator) < 0.5
        du = (u - center[:, 0].view(n, 1, 1, 1)).abs()
        dv = (v - center[:, 1].view(n, 1, 1, 1)).abs()
        hu, hv = half[:, 0].view(n, 1, 1, 1), half[:, 1].view(n, 1, 1, 1)
        rect = (du <= hu) & (dv <= hv)
        disc = du.square() + dv.square() <= hu.square()
        mask = torch.where(is_disc.view(n, 1, 1, 1), disc, rect) & (num_shapes > k).view(n, 1, 1, 1)
        images = torch.where(mask, color, images)
    return images * 2 - 1


# -- the VAE's calls ----------------------------------------------------------------------------


def _is_video(vae) -> bool:
    return type(vae).__name__ in VIDEO_VAES


def _encode(vae, images: torch.Tensor):
    """images [B, 3, H, W] -> (mean, logvar) of the posterior, [B, z, ...]."""
    x = images.unsqueeze(2) if _is_video(vae) else images
    posterior = vae.encode(x).latent_dist
    return posterior.mean, posterior.logvar


def _decode(vae, z: torch.Tensor) -> torch.Tensor:
    """raw latents [B, z, ...] -> images [B, 3, H, W] in about [-1, 1]."""
    out = vae.decode(z, return_dict=False)[0]
    return out[:, :, 0] if _is_video(vae) else out


def _set_latent_normalisation(vae, mean: torch.Tensor, std: torch.Tensor) -> None:
    """Make the family's decode map unit-scale latents onto the fitted latent distribution.

    mean/std are per channel. AutoencoderKL (SD3: z = latents / scaling_factor + shift_factor) has
    one scalar each; Qwen-Image/Wan (z = latents * latents_std + latents_mean) have config lists;
    LTX and LTX-2 (z = latents * latents_std / scaling_factor + latents_mean) have buffers.
    """
    rounded = lambda t: [round(float(x), 4) for x in t]  # noqa: E731 - short, written once to JSON
    name = type(vae).__name__
    if name == "AutoencoderKL":
        overall_mean = float(mean.mean())
        overall_std = float((std.square() + (mean - overall_mean).square()).mean().sqrt())
        vae.register_to_config(scaling_factor=round(1.0 / overall_std, 4), shift_factor=round(overall_mean, 4))
    elif name in ("AutoencoderKLQwenImage", "AutoencoderKLWan"):
        vae.register_to_config(latents_mean=rounded(mean), latents_std=rounded(std))
    elif name in ("AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video"):
        scaling = float(vae.config.scaling_factor)
        vae.latents_mean.copy_(torch.tensor(rounded(mean)))
        vae.latents_std.copy_(torch.tensor(rounded(std * scaling)))
    else:
        raise TypeError(f"no latent normalisation known for {name}")


# -- the fit ------------------------------------------------------------------------------------


def _colour_code(latent_channels: int, generator: torch.Generator, scale: float) -> torch.Tensor:
    """[z, 3]: orthogonal directions in latent space along which a cell's mean colour is written."""
    q, _ = torch.linalg.qr(torch.randn(latent_channels, 3, generator=generator))
    return q * scale


def _step(optimizer, params, loss: torch.Tensor, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
    optimizer.step()


def _fit(vae, seed: int, settings: FitSettings) -> dict[str, float]:
    """Two stages, both on fresh synthetic images from the seed in a fixed order.

    The tiny VAEs' GroupNorms (two to four channels a group) make a random autoencoder slow to
    discover how to carry a flat colour, so the decoder first learns a given code: the latent of
    an image is its mean colour per latent cell along fixed directions, plus unit noise. Then
    the encoder learns to write that code (the decoder is left as it is). The result reconstructs
    the images' colours and layout, and unit-scale latents decode to varied images.
    """
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        probe, _ = _encode(vae, synthetic_images(1, settings.image_size, data))
    cell = settings.image_size // probe.shape[-1]  # pixels per latent cell, per side
    code = _colour_code(probe.shape[1], data, settings.code_scale)

    def encode_colours(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        colours = F.avg_pool2d(images, cell)  # [B, 3, h, w]
        target = torch.einsum("zc,bchw->bzhw", code, colours)
        return colours, target.unsqueeze(2) if probe.dim() == 5 else target

    def losses(recon, images, colours):
        reconstruction = F.mse_loss(recon, images)
        return reconstruction, reconstruction + settings.coarse_weight * F.mse_loss(F.avg_pool2d(recon, cell), colours)

    vae.train()
    history: dict[str, float] = {}
    decoder = [p for n, p in vae.named_parameters() if not n.startswith(("encoder.", "quant_conv."))]
    optimizer = torch.optim.Adam(decoder, lr=settings.lr, foreach=False)
    for step in range(settings.decoder_steps):
        images = synthetic_images(settings.batch_size, settings.image_size, data)
        colours, target = encode_colours(images)
        z = target + settings.posterior_std * torch.randn(target.shape, generator=noise)
        reconstruction, loss = losses(_decode(vae, z), images, colours)
        _step(optimizer, decoder, loss, settings.lr * 0.5 * (1 + math.cos(math.pi * step / settings.decoder_steps)))
        history["decoder_first_mse" if step == 0 else "decoder_last_mse"] = reconstruction.item()

    encoder = [p for n, p in vae.named_parameters() if n.startswith(("encoder.", "quant_conv."))]
    optimizer = torch.optim.Adam(encoder, lr=settings.lr, foreach=False)
    for step in range(settings.encoder_steps):
        images = synthetic_images(settings.batch_size, settings.image_size, data)
        _, target = encode_colours(images)
        mean, _ = _encode(vae, images)
        loss = F.mse_loss(mean, target)
        _step(optimizer, encoder, loss, settings.lr * 0.5 * (1 + math.cos(math.pi * step / settings.encoder_steps)))
        history["encoder_first_mse" if step == 0 else "encoder_last_mse"] = loss.item()
    vae.eval()

    with torch.no_grad():
        images = synthetic_images(settings.stats_images, settings.image_size, data)
        mean, _ = _encode(vae, images)
        z = mean + settings.posterior_std * torch.randn(mean.shape, generator=noise)
        dims = [d for d in range(z.dim()) if d != 1]
        _set_latent_normalisation(vae, z.mean(dim=dims), z.std(dim=dims))
        history["autoencoder_mse"] = F.mse_loss(_decode(vae, z), images).item()
    return history


def fit_vae(vae, seed: int, settings: FitSettings = DEFAULT_SETTINGS) -> dict[str, float]:
    """Train `vae` in place (then eval mode) and set its latent normalisation; returns the MSEs."""
    if type(vae).__name__ not in SUPPORTED_VAES:
        raise TypeError(f"fit_vae does not know {type(vae).__name__}; it fits {', '.join(SUPPORTED_VAES)}")
    with deterministic_single_thread(), torch.enable_grad():
        return _fit(vae, seed, settings)
