"""Sample trajectories from a DiffusionModel: noise -> latents, recording every step.

Each distinct prompt is encoded once per call, its rows shared by its microgroups. A microgroup
(samples of one prompt, `--rollout-microgroup-size` of them) is denoised as one batch:
at each step one forward of the whole microgroup (`DiffusionModel.velocity`), and one VAE decode at
the end. The model's bits depend on that batch, so the trainer recomputes a step with exactly the
microgroup the engine forwarded, in its order (the batch plan's rollout tile). Microgroups are cut
from each prompt's samples in request order, and an engine receives whole prompts, so the tiles are
the same whatever the engine count.

Each sample draws all its noise (initial latents, then one draw per step up to the last step that
uses one) from its own generator seeded with its request's seed, in step order, so its noise is the
same whichever microgroup or engine it lands in. Steps in `trained_steps` use the SDE type and record a log-prob; the others
run as ODE.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from miles.models.loader import DiffusionModel, select_rows
from miles.rollout.sde import largest_sigma_below_one, ode_step, sde_step_on_host
from miles.rollout.types import Conditioning, SampleRequest, SamplingParams, Trajectory


def guidance_scales(model: DiffusionModel, params: SamplingParams) -> dict[str, float]:
    """Guidance per transformer component; 1.0 means no negative pass (unguided families).

    As WanPipeline: guidance is on only when the first (high-noise) scale is > 1; then each expert
    uses its own scale."""
    names = model.spec.transformer_components
    if not model.spec.guided or params.guidance_scale <= 1.0:
        return {name: 1.0 for name in names}
    scales = {names[0]: params.guidance_scale}
    if len(names) > 1:
        if params.guidance_scale_2 is None:
            raise ValueError(f"family {model.family} has two experts: --diffusion-guidance-scale-2 is required")
        scales[names[1]] = params.guidance_scale_2
    return scales


def sigmas_for(model: DiffusionModel, params: SamplingParams) -> list[float]:
    return model.sigmas(params.num_steps, params.shift, params.height, params.width, params.num_frames)


def expert_phases(model: DiffusionModel, params: SamplingParams) -> tuple[str, ...]:
    """The expert of every denoising step under the checkpoint's own schedule (() with one expert)."""
    if len(model.spec.transformer_components) < 2:
        return ()
    sigmas = sigmas_for(model, params)
    return tuple(model.expert_for_step(sigmas, step) for step in range(params.num_steps))


def sde_type_for(model: DiffusionModel, params: SamplingParams) -> str:
    return params.sde_type or model.spec.default_sde_type


def _microgroups(requests: list[SampleRequest], size: int | None) -> list[list[SampleRequest]]:
    groups: dict[int, list[SampleRequest]] = {}
    for r in requests:
        groups.setdefault(r.group_index, []).append(r)
    chunks = []
    for members in groups.values():
        step = size or len(members)
        chunks += [members[i : i + step] for i in range(0, len(members), step)]
    return chunks


def _denoise(model: DiffusionModel, requests: list[SampleRequest], cond: Conditioning, params: SamplingParams,
             trained_steps: list[int], debug: bool) -> list[Trajectory]:
    """One microgroup's trajectories; `cond` is its samples' conditioning, row for row."""
    sigmas = sigmas_for(model, params)
    sigma_max = largest_sigma_below_one(sigmas)
    shape = model.latent_shape(params.height, params.width, params.num_frames)
    sde_type = sde_type_for(model, params)
    scales = guidance_scales(model, params)
    trained = set(trained_steps)

    # sampling runs in inference mode (no autograd bookkeeping on any op); what leaves it below is
    # copied outside it, so the trajectories are ordinary tensors a trainer can differentiate through
    with torch.inference_mode():
        # one generator per sample, drawn one by one: what keeps a sample's noise independent of the
        # microgroup it lands in (a batched draw from one generator would depend on its neighbours)
        generators = [torch.Generator().manual_seed(r.seed) for r in requests]
        draw = lambda: torch.stack([torch.randn(shape, generator=g) for g in generators])  # noqa: E731
        # a sample's draw k + 1 is step k's noise, drawn whether the step uses it or not, up to the
        # last step that does: later draws would change nothing
        last_noisy = max(trained, default=-1) if sde_type != "ode" else -1
        no_log_prob = torch.zeros(len(requests))

        x = model.initial_latents(draw(), sigmas)
        latents, log_probs, outputs, experts, step_scales = [x], [], [], [], []
        for k in range(params.num_steps):
            expert = model.expert_for_step(sigmas, k)
            v = model.velocity(x, sigmas[k], cond, scales[expert], expert).cpu()
            noise = draw() if k <= last_noisy else None
            if k in trained and sde_type != "ode":
                step = sde_step_on_host(x, v, sigmas[k], sigmas[k + 1], params.noise_level, sde_type, noise=noise,
                                        sigma_max=sigma_max)
                x, log_prob = step.x_next, step.log_prob
            else:
                x, log_prob = ode_step(x, v, sigmas[k], sigmas[k + 1]), no_log_prob
            latents.append(x)
            log_probs.append(log_prob)
            experts.append(expert)
            step_scales.append(scales[expert])
            if debug:
                outputs.append(v)
        images = model.decode(model.pipeline_latents(x, sigmas[-1]))

    cond = cond.to("cpu")
    stacked = torch.stack(latents, dim=1)  # [B, N + 1, ...]
    output_table = torch.stack(outputs, dim=1) if debug else None
    del latents, outputs  # the path is held once from here (its rows are views until a caller copies them)
    log_prob_table = torch.stack(log_probs, dim=1)  # [B, N]
    return [
        Trajectory(
            prompt=r.prompt, group_index=r.group_index, sample_index=r.sample_index, seed=r.seed,
            latents=stacked[i], sigmas=torch.tensor(sigmas, dtype=torch.float32),
            log_probs=log_prob_table[i].clone(), trained_steps=sorted(trained), cond=cond.select(i),
            experts=list(experts), guidance_scales=list(step_scales), sde_type=sde_type,
            noise_level=params.noise_level, image=images[i],
            model_outputs=None if output_table is None else output_table[i],
            metadata=dict(r.metadata),
        )
        for i, r in enumerate(requests)
    ]


def own_copies(requests: list[SampleRequest], trajectories: list[Trajectory]) -> list[Trajectory]:
    """Each trajectory with tensors of its own (a pickled view would carry its whole microgroup) and
    outside inference mode, so a trainer can differentiate through them."""
    copy = lambda t: None if t is None else t.clone()  # noqa: E731
    return [replace(t, latents=t.latents.clone(), image=copy(t.image), model_outputs=copy(t.model_outputs))
            for t in trajectories]


def generate(model: DiffusionModel, requests: list[SampleRequest], params: SamplingParams,
             trained_steps: list[int], debug: bool = False,
             finish: Callable[[list[SampleRequest], list[Trajectory]], list[Any]] | None = None) -> list[Any]:
    """Trajectories in request order; prompts are evaluated in microgroups of their own group.

    `finish(requests, trajectories)`, when given, takes each microgroup's trajectories as soon as
    they are made and returns what stands for them in the answer (miles.rollout.engine_store puts
    them away), so at most one microgroup's whole paths are held at a time."""
    bad = [k for k in trained_steps if not 0 <= k < params.num_steps]
    if bad:
        raise ValueError(f"trained steps {bad} are outside [0, {params.num_steps})")
    if not requests:
        return []
    # each distinct prompt encoded once for all its microgroups (a text is encoded alone, so its rows
    # are the same bits whichever microgroup takes them)
    prompts = list(dict.fromkeys(r.prompt for r in requests))
    row_of = {p: i for i, p in enumerate(prompts)}
    with torch.inference_mode():
        encoded = model.encode_prompts(prompts, params.negative_prompt, params.max_sequence_length)
    by_id = {}
    for chunk in _microgroups(requests, params.microgroup_size):
        cond = select_rows(encoded, [row_of[r.prompt] for r in chunk])
        made = _denoise(model, chunk, cond, params, trained_steps, debug)
        for r, t in zip(chunk, (finish or own_copies)(chunk, made)):
            by_id[id(r)] = t
    return [by_id[id(r)] for r in requests]
