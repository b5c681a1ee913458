"""Sampling throughput against the diffusers pipeline, the Ray train step against a plain loop, and
where a short main job's wall time goes, measured in one run.

    python3 benchmarks/bench_sampling.py [--pairs 5] [--rounds 5] [--workdir DIR] [--no-train] [--no-job]

1. Images per second of the rollout engine (`RolloutEngine.generate`, whatever it batches) and of
   `StableDiffusion3Pipeline` loaded from the same checkpoint, at batch 1, 4 and 8 (8 steps,
   64x64, guidance 4, one thread, pinned numerics), on the tiny sd3 and on a ~20 M-parameter sd3
   (the tiny checkpoint with a wider, deeper transformer built by the proxy-asset code). Both
   start from the prompt text and decode to images. Our sd3 checkpoints have one CLIP, which the
   pipeline cannot encode with, so the pipeline's embeddings come from the same text-encoder call
   the engine makes (`DiffusionModel.encode_prompts`), made inside its timing as the engine makes
   it inside its own. The two run in interleaved pairs, the order alternating; the ratio is of the
   medians over `--pairs` pairs, after a warm-up pair.
2. The train step, Ray / plain: `benchmarks/bench_trainer.py`'s measurement (`--rounds`).
3. The tiny recipe's main job with 5 rollouts, run as users run it: the share of its wall time in
   start-up (recipe process start to the first rollout), the training loop and shutdown (loop end
   to the cluster's teardown), from the phase marks the run writes (miles/records/phases.py), with
   the biggest start-up phases listed.
The load average is printed before and after: compare runs made under similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from miles.utils.numerics import pin_this_process

pin_this_process()  # before torch loads: the engine's actors run pinned, so the benchmark does too

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BATCHES = (1, 4, 8)
STEPS, SIZE, GUIDANCE = 8, 64, 4.0
PROMPT = "a red circle on a blue background"
# the ~20 M model: the tiny sd3 transformer at width 320 (5 heads of 64) and 6 joint blocks
WIDE_TRANSFORMER = dict(num_layers=6, attention_head_dim=64, num_attention_heads=5, caption_projection_dim=320)


def build_wide_checkpoint(tiny: Path, out: Path) -> Path:
    """The tiny checkpoint (its text encoder, tokenizer, fitted VAE, scheduler) with a ~20 M transformer."""
    from miles.models.registry import get_family
    from miles.proxy_assets.checkpoint import build_component

    if (out / "model_index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    spec = get_family("sd3").module.components("tiny")["transformer"]
    wide = type(spec)(spec.library, spec.class_name, {**spec.config, **WIDE_TRANSFORMER})
    shutil.rmtree(tmp / "transformer")
    build_component(wide, seed=20).save_pretrained(tmp / "transformer")
    os.replace(tmp, out)
    return out


class SamplingPair:
    """The engine and the pipeline on one checkpoint, each producing decoded images."""

    def __init__(self, checkpoint: Path):
        import diffusers

        from miles.rollout.engine import RolloutEngine
        from miles.rollout.types import SamplingParams, SampleRequest

        params = SamplingParams(num_steps=STEPS, height=SIZE, width=SIZE, guidance_scale=GUIDANCE)
        self.engine = RolloutEngine(checkpoint, params, num_threads=1)
        self.requests = lambda n: [SampleRequest(PROMPT, 0, i, seed=100 + i) for i in range(n)]  # noqa: E731
        self.pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(
            str(checkpoint), dtype=torch.float32, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
            tokenizer_3=None)
        self.pipe.set_progress_bar_config(disable=True)
        self.latent_shape = self.engine.model.latent_shape(SIZE, SIZE, 1)
        self.params = sum(p.numel() for p in self.engine.model.transformers["transformer"].parameters())

    def run_engine(self, batch: int) -> float:
        start = time.perf_counter()
        images = [t.image for t in self.engine.generate(self.requests(batch), trained_steps=[])]
        assert len(images) == batch
        return time.perf_counter() - start

    def run_pipeline(self, batch: int) -> float:
        generator = torch.Generator().manual_seed(100)
        latents = torch.randn((batch, *self.latent_shape), generator=generator)
        start = time.perf_counter()
        embeds = {k: v.expand(batch, *v.shape[1:]) for k, v in self.prompt_embeds().items()}  # `batch` samples
        with torch.no_grad():
            images = self.pipe(num_inference_steps=STEPS, height=SIZE, width=SIZE, guidance_scale=GUIDANCE,
                               latents=latents, output_type="pt", **embeds).images
        assert images.shape[0] == batch
        return time.perf_counter() - start

    def prompt_embeds(self) -> dict[str, torch.Tensor]:
        """The pipeline's four embedding arguments for PROMPT, from the engine's own encoding call."""
        with torch.inference_mode():
            params = self.engine.params
            cond = self.engine.model.encode_prompts([PROMPT], params.negative_prompt, params.max_sequence_length)
        return dict(prompt_embeds=cond.positive["encoder_hidden_states"],
                    pooled_prompt_embeds=cond.positive["pooled_projections"],
                    negative_prompt_embeds=cond.negative["encoder_hidden_states"],
                    negative_pooled_prompt_embeds=cond.negative["pooled_projections"])


def measure_sampling(label: str, checkpoint: Path, pairs: int) -> list[str]:
    sampling = SamplingPair(checkpoint)
    lines = [f"{label}: transformer {sampling.params / 1e6:.1f} M parameters"]
    for batch in BATCHES:
        engine, pipeline = [], []
        for index in range(pairs + 1):  # pair 0 warms both up
            first_engine = index % 2 == 0
            times = {}
            for which in ("engine", "pipeline") if first_engine else ("pipeline", "engine"):
                times[which] = sampling.run_engine(batch) if which == "engine" else sampling.run_pipeline(batch)
            if index:
                engine.append(times["engine"])
                pipeline.append(times["pipeline"])
        e, p = statistics.median(engine), statistics.median(pipeline)
        lines.append(f"  batch {batch}: engine {batch / e:7.2f} img/s, pipeline {batch / p:7.2f} img/s, "
                     f"engine / pipeline {p / e:5.2f}  (medians of {pairs}: engine "
                     f"{', '.join(f'{t:.2f}' for t in engine)} s; pipeline {', '.join(f'{t:.2f}' for t in pipeline)} s)")
    return lines


def measure_main_job(work: Path, num_rollout: int) -> list[str]:
    """The tiny recipe with `num_rollout` rollouts, as a user runs it; its phase marks read back."""
    from miles.records import phases

    marks_file = work / "job_phases.jsonl"
    marks_file.unlink(missing_ok=True)
    env = {**os.environ, phases.PHASES_ENV: str(marks_file)}
    env.pop("MILES_SCRIPT_ENABLE_RAY_SUBMIT", None)
    command = [sys.executable, str(REPO / "scripts/run_diffusion_grpo_tiny_cpu.py"), "--num-rollout", str(num_rollout),
               "--output-dir", str(work / "job"), "--run-id", f"bench-{int(time.time())}",
               "--model-dir", str(work / "models"), "--data-dir", str(work / "data")]
    start = time.time()
    proc = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        return [f"main job failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"]
    return job_shares(phases.read_marks(marks_file), wall, num_rollout)


def job_shares(marks: list[dict], wall: float, num_rollout: int) -> list[str]:
    from miles.records.phases import breakdown

    first = lambda name: next((m["t"] for m in marks if m["phase"] == name), None)  # noqa: E731
    begin = first("recipe_process_start")
    loop_start, loop_end = first("loop_start"), first("loop_end")
    missing = [name for name, t in (("recipe_process_start", begin), ("loop_start", loop_start),
                                    ("loop_end", loop_end)) if t is None]
    if missing:
        return [f"main job: the run wrote no {', '.join(missing)} mark ({len(marks)} marks, {wall:.1f}s wall)"]
    end = max(m["t"] for m in marks)
    total = end - begin
    parts = [("start-up (recipe process start to the first rollout)", loop_start - begin),
             (f"training loop ({num_rollout} rollouts)", loop_end - loop_start),
             ("shutdown (loop end to the cluster's teardown)", end - loop_end)]
    lines = [f"main job: {total:.1f}s from the recipe process's start to the last mark ({wall:.1f}s wall)"]
    lines += [f"  {label:55s} {seconds:6.1f}s  {100 * seconds / total:5.1f} %" for label, seconds in parts]
    lines.append("  phases (miles.records.phases.breakdown):")
    lines += [f"    {label:60s} {seconds:6.1f}s" for label, seconds in breakdown(marks)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="timed engine/pipeline pairs per batch size")
    parser.add_argument("--rounds", type=int, default=5, help="timed plain/Ray train-step rounds")
    parser.add_argument("--num-rollout", type=int, default=5, help="rollouts of the main job")
    parser.add_argument("--workdir", default=None, help="where checkpoints and runs go (default: a temp dir)")
    parser.add_argument("--no-train", action="store_true", help="skip the train step")
    parser.add_argument("--no-job", action="store_true", help="skip the main job")
    opts = parser.parse_args()

    from miles.models.runtime import configure_torch, quiet_libraries
    from miles.proxy_assets.checkpoint import ensure_checkpoint

    configure_torch(num_threads=1)
    quiet_libraries()
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="bench_sampling_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    tiny = ensure_checkpoint("sd3", "tiny", 0, work / "models")
    wide = build_wide_checkpoint(tiny, work / "models" / "miles-sd3-wide20m-seed0")
    print(f"sampling: {STEPS} steps, {SIZE}x{SIZE}, guidance {GUIDANCE}, 1 thread, images decoded", flush=True)
    for label, checkpoint in (("tiny sd3", tiny), ("~20 M sd3", wide)):
        print("\n".join(measure_sampling(label, checkpoint, opts.pairs)), flush=True)
    if not opts.no_train:
        sys.path.insert(0, str(REPO / "benchmarks"))
        import bench_trainer

        print("train step:", flush=True)
        bench_trainer.report(bench_trainer.measure(work / "trainer", opts.rounds))
    if not opts.no_job:
        print("\n".join(measure_main_job(work, opts.num_rollout)), flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
