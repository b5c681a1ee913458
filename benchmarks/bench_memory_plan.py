"""Validate the memory plan's train-rank model on the CPU against the measured peak RSS delta.

    nice -n 19 python3 benchmarks/bench_memory_plan.py [--layers 6] [--gradient-checkpointing]

Builds an SD3 transformer (a scaled-down SD3.5 block stack) and saves it as a checkpoint folder
the estimator reads from its safetensors headers. Then, in this process, repeats what a train rank
of the data-parallel backend holds at its peak (miles/backends/actor.py): the float32 master, the
bfloat16 compute copy, one micro-batch of guided forwards (cond + uncond per pair, one sample at a
time, graph kept to the backward), backward into the copy, the gradients packed into the flat
float32 buffer whose views the step reads, and AdamW (foreach=False). It prints the estimate's
terms (the CUDA-context term left out: there is no CUDA here), the measured peak RSS minus the RSS
before the first model was built, and their ratio. docs/memory-plan.md records the result.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    opts = ap.parse_args()

    import torch
    from diffusers import SD3Transformer2DModel

    from miles.flags.arguments import parse_and_plan
    from miles.plan.memory_plan import GIB, GEOMETRY, _text_tokens, _tokens, _train_rank, model_facts

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = dict(sample_size=opts.resolution // 8, patch_size=2, in_channels=16, out_channels=16,
                  num_layers=opts.layers, attention_head_dim=64, num_attention_heads=12, joint_attention_dim=768,
                  caption_projection_dim=768, pooled_projection_dim=768, pos_embed_max_size=opts.resolution // 8)
    tmp = Path(tempfile.mkdtemp(prefix="memplan-"))
    ckpt = tmp / "bench-sd3"
    SD3Transformer2DModel(**config).save_pretrained(ckpt / "transformer")
    argv = ["--hf-checkpoint", str(ckpt), "--diffusion-model-family", "sd3", "--num-rollout", "1",
            "--rm-type", "brightness", "--prompt-data", "p.jsonl", "--rollout-batch-size", "1",
            "--n-samples-per-prompt", str(opts.pairs), "--diffusion-num-sde-steps", "1",
            "--diffusion-height", str(opts.resolution), "--diffusion-width", str(opts.resolution),
            "--micro-batch-size", str(opts.pairs), "--compute-dtype", "bfloat16", "--rollout-dtype", "bfloat16",
            "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--colocate"]
    if opts.gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    ns, plan = parse_and_plan(argv)
    facts = model_facts(str(ckpt))
    geo = GEOMETRY["sd3"]
    role, _ = _train_rank(ns, plan, facts, geo)
    estimate = sum(b for what, b in role.terms if not what.startswith("CUDA"))
    image, text = _tokens(ns, geo, _text_tokens(ns))

    # the same inputs a micro-batch feeds the copy
    latent = torch.randn(1, 16, opts.resolution // 8, opts.resolution // 8)
    prompt = torch.randn(1, text, 768)
    pooled = torch.randn(1, 768)
    before = rss_kib("VmRSS")
    master = SD3Transformer2DModel.from_pretrained(ckpt / "transformer", torch_dtype=torch.float32)
    fmodel = copy.deepcopy(master).to(torch.bfloat16)
    if opts.gradient_checkpointing:
        fmodel.enable_gradient_checkpointing()
    params, fparams = list(master.parameters()), list(fmodel.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    for step in range(2):  # the second step has AdamW's state allocated: the steady-state peak
        loss = 0.0
        for _ in range(opts.pairs * 2):  # guided: cond and uncond, one sample at a time
            out = fmodel(hidden_states=latent.bfloat16(), encoder_hidden_states=prompt.bfloat16(),
                         pooled_projections=pooled.bfloat16(), timestep=torch.tensor([500.0]), return_dict=False)[0]
            loss = loss + out.float().square().mean()
        loss.backward()
        flat = torch.empty(sum(p.numel() for p in params))
        offset = 0
        for f in fparams:  # as actor._optimizer_step packs them
            flat[offset:offset + f.numel()].copy_(f.grad.reshape(-1))
            f.grad = None
            offset += f.numel()
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        del flat
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, f in zip(params, fparams):
                f.copy_(p)
    measured = (rss_kib("VmHWM") - before) * 1024
    print(json.dumps({"layers": opts.layers, "params": sum(p.numel() for p in params),
                      "tokens": image + text, "pairs": opts.pairs,
                      "gradient_checkpointing": opts.gradient_checkpointing}))
    for what, b in role.terms:
        if not what.startswith("CUDA"):
            print(f"  {b / GIB:8.3f} GiB  {what}")
    print(f"estimate {estimate / GIB:.3f} GiB, measured peak RSS delta {measured / GIB:.3f} GiB, "
          f"measured / estimate = {measured / estimate:.2f}")


if __name__ == "__main__":
    main()
