"""Sample a checkpoint and write an image grid, for a person looking at a model.

    python3 -m miles.rollout.sample --hf-checkpoint DIR --prompt P --num-samples 4 --seed 0 --out grid.png

One row per sample; video families show each sample's frames as a strip along its row. Sample i
uses seed `--seed + i`, so the same seed gives the same pixels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from miles.utils.cli_types import at_least

if TYPE_CHECKING:  # torch, PIL and the engine load after parsing: --help answers at once
    import torch
    from PIL import Image


def image_grid(images: list[torch.Tensor], columns: int | None = None) -> Image.Image:
    """Images [3, H, W] tiled `columns` per row (default: one row), or videos [F, 3, H, W] one per row."""
    import numpy as np
    import torch
    from PIL import Image

    if images[0].ndim == 4:
        rows = [torch.cat(list(video), dim=-1) for video in images]  # frames side by side
    else:
        columns = columns or len(images)
        rows = []
        for start in range(0, len(images), columns):
            row = images[start : start + columns]
            row += [torch.zeros_like(images[0])] * (columns - len(row))
            rows.append(torch.cat(row, dim=-1))
    grid = torch.cat(rows, dim=-2).clamp(0, 1)
    pixels = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(pixels)


def _pixels(value: str) -> int:
    return at_least(16, 16, "the VAE's 8x downsampling times the transformer's 2x2 patch")(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m miles.rollout.sample", description=__doc__.splitlines()[0])
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--num-samples", type=at_least(1), default=4)
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--family", default=None, help="default: from the checkpoint")
    p.add_argument("--num-steps", type=at_least(1), default=10)
    p.add_argument("--height", type=_pixels, default=64)
    p.add_argument("--width", type=_pixels, default=64)
    p.add_argument("--num-frames", type=at_least(1), default=None, help="video families; default 5")
    p.add_argument("--guidance-scale", type=float, default=4.0)
    p.add_argument("--guidance-scale-2", type=float, default=None, help="Wan2.2's low-noise expert (required there)")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--sde-type", default=None, choices=("sde", "ode", "cps"), help="default: the family's")
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            _fail("--device cuda: this machine has no CUDA device torch can use; fix: --device cpu (or drop --device)")
    if not Path(args.hf_checkpoint).is_dir():
        _fail(f"--hf-checkpoint {args.hf_checkpoint}: no such directory; fix: give a checkpoint folder "
              f"(model_index.json inside)")
    try:
        return _sample(args)
    except (OSError, ValueError, KeyError) as err:  # a corrupt checkpoint, a value the family refuses
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _fail(f"--hf-checkpoint {args.hf_checkpoint}: cannot sample: {type(err).__name__}: {reason}; fix: check the "
              f"checkpoint (or recreate it: python3 -m miles.proxy_assets.checkpoint ... --out DIR)")
    except Exception as err:  # anything else: one line here, the traceback in a log beside --out
        log = Path(args.out).with_suffix(".error.log")
        import traceback

        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        _fail(f"sampling {args.hf_checkpoint} failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
              f"traceback in {log}")


def _fail(line: str):
    print(f"python3 -m miles.rollout.sample: error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _sample(args: argparse.Namespace) -> Path:
    import torch

    from miles.rollout.engine import RolloutEngine
    from miles.rollout.types import SampleRequest, SamplingParams

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    params = SamplingParams(
        num_steps=args.num_steps, height=args.height, width=args.width, num_frames=args.num_frames or 1,
        guidance_scale=args.guidance_scale, guidance_scale_2=args.guidance_scale_2, noise_level=args.noise_level,
        sde_type=args.sde_type, negative_prompt=args.negative_prompt,
    )
    engine = RolloutEngine(args.hf_checkpoint, params, family=args.family, device=args.device)
    if engine.model.spec.is_video and args.num_frames is None:
        engine.params.num_frames = 5
    requests = [SampleRequest(args.prompt, 0, i, args.seed + i) for i in range(args.num_samples)]
    trajectories = engine.generate(requests, trained_steps=list(range(args.num_steps)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image_grid([t.image for t in trajectories]).save(out)
    print(out)
    return out


if __name__ == "__main__":
    main()
