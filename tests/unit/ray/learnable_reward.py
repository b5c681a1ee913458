"""A reward the tiny sd3 checkpoint can express: the left half of the image brighter than the right.

Used to show the trainer learns (tests and the learning numbers of the trainer's report): the
tiny random VAE maps latent *patterns* to pixels but barely moves an image's mean colour, so
spatial structure is what a few minutes of RL on a CPU can change.
"""

from __future__ import annotations


async def left_brighter(args, samples) -> list[float]:
    scores = []
    for sample in samples:
        frames = sample.frames()  # [F, 3, H, W] in [0, 1]
        half = frames.shape[-1] // 2
        scores.append(float(frames[..., :half].mean() - frames[..., half:].mean()))
    return scores
