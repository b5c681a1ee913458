"""What a reward sees and what it raises.

`RewardSample` crosses into reward actors, so it holds only a prompt, pixels and a metadata
dict. Rewards take it as `async def rm(args, samples) -> list[float]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

RewardFn = Callable[[Any, list["RewardSample"]], Awaitable[list[Any]]]


class RewardError(RuntimeError):
    """A reward could not score a batch; the message names the reward and the sample."""


def _to_numpy(image: Any) -> np.ndarray:
    if isinstance(image, np.ndarray) and image.dtype == np.uint8:  # 8-bit pixels (miles.ray.reward_pool)
        return image.astype(np.float32) / np.float32(255.0)
    if hasattr(image, "detach"):  # a torch tensor; checked by duck type so torch stays optional here
        image = image.detach().to("cpu").float().numpy()
    return np.asarray(image, dtype=np.float32)


@dataclass
class RewardSample:
    """A prompt and its generated image `[3, H, W]` or video `[F, 3, H, W]`, values in [0, 1].

    `image` may be a numpy array or a torch tensor (any device, any float dtype), or uint8
    pixels (0..255, read as value / 255).
    """

    prompt: str
    image: Any
    metadata: dict[str, Any] = field(default_factory=dict)

    def frames(self) -> np.ndarray:
        """The pixels as float32 `[F, 3, H, W]` clipped to [0, 1] (an image is one frame)."""
        pixels = _to_numpy(self.image)
        if pixels.ndim == 3:
            pixels = pixels[None]
        if pixels.ndim != 4 or pixels.shape[1] != 3:
            raise ValueError(f"expected an image [3, H, W] or frames [F, 3, H, W], got shape {tuple(pixels.shape)}")
        return np.clip(pixels, 0.0, 1.0)

    @property
    def is_video(self) -> bool:
        return len(getattr(self.image, "shape", ())) == 4

    def to_wire(self) -> "RewardSample":
        """A copy whose pixels are a CPU numpy array, cheap to ship to a reward actor."""
        return RewardSample(self.prompt, _to_numpy(self.image), dict(self.metadata))


def frame_to_pil(frame: np.ndarray):
    """One `[3, H, W]` frame in [0, 1] as an 8-bit RGB PIL image (what OCR and CLIP expect)."""
    from PIL import Image

    return Image.fromarray(np.round(np.transpose(frame, (1, 2, 0)) * 255.0).astype(np.uint8))


def pick_frames(frames: np.ndarray, count: int) -> np.ndarray:
    """Up to `count` frames spread evenly over a video, first and last included."""
    if len(frames) <= count:
        return frames
    return frames[np.linspace(0, len(frames) - 1, count).round().astype(int)]
