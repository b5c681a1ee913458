"""What an eval costs at the run's size, printed in the memory plan. Torch-free.

An eval samples one image or video per eval prompt on the rollout engines, every step an ODE step,
with `--diffusion-eval-num-steps` steps (unset: the training samples' count), and scores them; the
engines keep only the reward frames, dropped once scored (miles.ray.rollout_manager). Its cost is
given two ways: exactly, as a fraction of a training rollout's sampling (sample-steps against
sample-steps), and as a time, from the transformer's forward FLOPs at EVAL_FLOPS_PER_GPU per
engine (an assumption: a bfloat16 diffusion transformer on an H100/H200 at about 40 % of its
989 TFLOP/s dense peak; the VAE decode and the reward are left out).
"""

from __future__ import annotations

from argparse import Namespace

EVAL_FLOPS_PER_GPU = 400e12


def eval_lines(ns: Namespace, plan, facts) -> list[str]:
    if ns.loss_type == "sft_loss" or not getattr(ns, "eval_interval", None):
        return ["eval: none (no --eval-interval)" if ns.loss_type != "sft_loss" else "eval: none (SFT runs no engines)"]
    from miles.plan.placement_plan import num_rollout_engines

    prompts = ns.eval_num_prompts
    steps = ns.diffusion_eval_num_steps or ns.diffusion_num_steps
    before = "" if getattr(ns, "skip_eval_before_train", False) else ", and once before training"
    if not prompts:
        return [f"eval: every prompt of {ns.eval_prompt_data or ns.prompt_data} x {steps} steps every "
                f"{ns.eval_interval} rollouts{before} (set --eval-num-prompts to bound it)"]
    share = prompts * steps / (plan.samples_per_rollout * ns.diffusion_num_steps)
    engines = num_rollout_engines(ns)
    seconds = prompts * steps * step_flops(ns, facts) / (engines * EVAL_FLOPS_PER_GPU)
    return [f"eval: {prompts} prompts x {steps} steps every {ns.eval_interval} rollouts{before}: {share:.2f} of a "
            f"training rollout's sampling ({share / ns.eval_interval:.1%} of the run's); about {seconds / 60:.1f} min "
            f"on {engines} engines at an assumed {EVAL_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s a GPU (transformer forwards)"]


def step_flops(ns: Namespace, facts) -> float:
    """One sample's denoising step: its transformer forwards (two when guided), matmuls and attention."""
    from miles.plan.model_facts import GEOMETRY, _guided, _text_tokens, _tokens

    geo = GEOMETRY[ns.diffusion_model_family]
    comps = facts.components
    big = max((n for n in comps if n.startswith("transformer")), key=lambda n: comps[n].params)
    hidden, blocks = comps[big].hidden or 0, comps[big].blocks or 0
    text = _text_tokens(ns)
    image, joint = _tokens(ns, geo, text)
    tokens = image + joint
    attention = 4 * tokens * tokens * hidden * blocks + (0 if joint else 4 * image * text * hidden * blocks)
    return (2 if _guided(ns) else 1) * (2 * comps[big].params * tokens + attention)
