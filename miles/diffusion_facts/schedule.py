"""The flow-matching sigma schedule, built exactly as diffusers builds it; torch-free.

This is the one place schedules are made. `flow_match_sigmas` mirrors
`FlowMatchEulerDiscreteScheduler.__init__` + `set_timesteps` of diffusers 0.42 bit for bit (it
repeats the float32 roundings numpy and torch do there), for the two ways pipelines call it:
`linspace_sigmas=False` is `set_timesteps(N)` (StableDiffusion3Pipeline, WanPipeline: timesteps
from 1 to the scheduler's own minimum, then shifted), `True` passes `sigmas=linspace(1, 1/N, N)`
(QwenImagePipeline, LTXPipeline). `mu` is the dynamic-shifting exponent the pipeline computes from
the latent sequence length (`calculate_shift`). sigma runs from 1 to 0 (the appended terminal);
step k goes from sigmas[k] to sigmas[k + 1].

`edm_flow_sigmas` is Cosmos2TextToImagePipeline's schedule: EDM sigmas (Karras, from `sigma_max`
to `sigma_min`, the last step held at `sigma_min`) as the flow-matching times t = s / (1 + s) the
transformer is called with.

The validator uses `sigma_schedule(num_steps, shift)`, the same function with a plain
`FlowMatchEulerDiscreteScheduler(shift=shift)` config, so the plan places Wan2.2 experts where the
sampler does for a checkpoint whose scheduler has that config.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable

NUM_TRAIN_TIMESTEPS = 1000

# FlowMatchEulerDiscreteScheduler's defaults: what a key missing from scheduler_config.json means
FLOW_MATCH_DEFAULTS: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False, "base_shift": 0.5,
    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096, "invert_sigmas": False,
    "shift_terminal": None, "use_karras_sigmas": False, "use_exponential_sigmas": False,
    "use_beta_sigmas": False, "time_shift_type": "exponential", "stochastic_sampling": False,
}
_UNSUPPORTED = ("invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "stochastic_sampling")


def _f32(x: float) -> float:
    """x rounded to float32 (float64 arithmetic then this rounding is exact float32 arithmetic)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _same(x: float) -> float:
    return x


# what an EDM-coordinates pipeline (Cosmos2) reads from the scheduler config beside FlowMatchEuler's own
EDM_KEYS = ("sigma_min", "sigma_max", "sigma_data", "final_sigmas_type")
KARRAS_RHO = 7.0


def flow_match_config(config: dict[str, Any], *, edm: bool = False) -> dict[str, Any]:
    """A scheduler_config.json as the FlowMatchEulerDiscreteScheduler config the sampler runs.

    A flow-sigma scheduler of another kind (UniPC/DPM++ with `flow_shift`, as Wan releases) maps
    to a FlowMatchEuler scheduler with `shift = flow_shift`: the SDE sampler needs one Euler-type
    step per sigma pair, which a multistep solver is not. `edm`: the family's pipeline samples in
    EDM coordinates (Cosmos2), whose config must use Karras sigmas between sigma_min and sigma_max."""
    if edm:
        return _edm_config(config)
    cls = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if cls == "FlowMatchEulerDiscreteScheduler":
        merged = {**FLOW_MATCH_DEFAULTS, **{k: v for k, v in config.items() if k in FLOW_MATCH_DEFAULTS}}
    elif "flow_shift" in config:
        merged = {**FLOW_MATCH_DEFAULTS, "num_train_timesteps": config.get("num_train_timesteps", 1000),
                  "shift": config["flow_shift"] or 1.0}
    else:
        raise ValueError(f"scheduler {cls} is not a flow-matching scheduler (no flow_shift); cannot sample it")
    bad = [k for k in _UNSUPPORTED if merged[k]]
    if bad:
        raise ValueError(f"scheduler options {bad} are not supported by the flow-matching sampler")
    return merged


def _edm_config(config: dict[str, Any]) -> dict[str, Any]:
    merged = {**FLOW_MATCH_DEFAULTS, **{k: v for k, v in config.items() if k in FLOW_MATCH_DEFAULTS or k in EDM_KEYS}}
    missing = [k for k in ("sigma_min", "sigma_max") if merged.get(k) is None]
    if not merged["use_karras_sigmas"] or missing:
        raise ValueError(f"an EDM-coordinates scheduler needs use_karras_sigmas and sigma_min/sigma_max "
                         f"(Cosmos2TextToImagePipeline's config); this one has use_karras_sigmas="
                         f"{merged['use_karras_sigmas']}, missing {missing}")
    bad = [k for k in ("invert_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_dynamic_shifting",
                       "stochastic_sampling") if merged[k]]
    if bad:
        raise ValueError(f"scheduler options {bad} are not supported with EDM (Karras) sigmas")
    return merged


def edm_flow_sigmas(config: dict[str, Any], num_steps: int) -> list[float]:
    """Cosmos2TextToImagePipeline's schedule as flow-matching times, num_steps + 1 float32 values.

    The pipeline's EDM sigmas are Karras's (rho 7) from sigma_max down to sigma_min (the shift of
    its linspace input is ignored by the Karras conversion); with `final_sigmas_type: sigma_min` the
    terminal sigma is sigma_min again, so the last step holds still. Each becomes the time the
    transformer sees, t = s / (s + 1) in float32, and a flow Euler step between two such times is
    the pipeline's EDM Euler step in the coordinates x_flow = x_edm / (1 + s).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    config = _edm_config(config)
    lo, hi = config["sigma_min"] ** (1 / KARRAS_RHO), config["sigma_max"] ** (1 / KARRAS_RHO)
    sigmas = [_f32((hi + r * (lo - hi)) ** KARRAS_RHO) for r in _linspace(0.0, 1.0, num_steps)]
    terminal = sigmas[-1] if config.get("final_sigmas_type", "zero") == "sigma_min" else 0.0
    return [_f32(s / _f32(s + 1.0)) for s in sigmas + [terminal]]


def calculate_shift(seq_len: int, config: dict[str, Any]) -> float:
    """The pipelines' `calculate_shift`: mu linear in the latent sequence length."""
    m = (config["max_shift"] - config["base_shift"]) / (config["max_image_seq_len"] - config["base_image_seq_len"])
    b = config["base_shift"] - m * config["base_image_seq_len"]
    return seq_len * m + b


def _linspace(start: float, stop: float, num: int) -> list[float]:
    """numpy.linspace in float64, term by term as numpy computes it."""
    if num == 1:
        return [start]
    step = (stop - start) / (num - 1)
    return [k * step + start for k in range(num - 1)] + [stop]


def _init_sigma_min(config: dict[str, Any]) -> float:
    """The smallest training sigma of `__init__` (shifted there already when not dynamic; float32)."""
    s = _f32(1.0 / config["num_train_timesteps"])
    if config["use_dynamic_shifting"]:
        return s
    shift = _f32(config["shift"])
    return _f32(_f32(shift * s) / _f32(1.0 + _f32(_f32(config["shift"] - 1.0) * s)))


def _time_shift(config: dict[str, Any], mu: float, t: float, r: Callable[[float], float]) -> float:
    tail = r(r(1.0 / t) - 1.0)  # ** sigma with sigma = 1.0 is exact
    if config["time_shift_type"] == "exponential":
        e = r(math.exp(mu))
        return r(e / r(e + tail))
    return r(r(mu) / r(r(mu) + tail))


def flow_match_sigmas(config: dict[str, Any], num_steps: int, *, linspace_sigmas: bool = False,
                      mu: float | None = None) -> list[float]:
    """num_steps + 1 float32 sigmas (as Python floats), the last 0.0; see the module docstring."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    config = flow_match_config(config)
    if config["use_dynamic_shifting"] and mu is None:
        raise ValueError("this scheduler shifts dynamically: mu (from the latent sequence length) is required")
    if linspace_sigmas:  # np.array(sigmas).astype(np.float32): float32 from here on
        r = _f32
        raw = [r(s) for s in _linspace(1.0, 1.0 / num_steps, num_steps)]
    else:  # float64 numpy until the final cast
        r = _same
        t_max, t_min = 1.0 * config["num_train_timesteps"], _init_sigma_min(config) * config["num_train_timesteps"]
        raw = [t / config["num_train_timesteps"] for t in _linspace(t_max, t_min, num_steps)]
    if config["use_dynamic_shifting"]:
        sigmas = [_time_shift(config, mu, s, r) for s in raw]
    else:
        shift = r(config["shift"])
        sigmas = [r(r(shift * s) / r(1.0 + r(r(config["shift"] - 1.0) * s))) for s in raw]
    if config["shift_terminal"]:
        scale = r(r(1.0 - sigmas[-1]) / r(1.0 - config["shift_terminal"]))
        if scale == 0.0:  # diffusers would return NaNs
            raise ValueError(f"shift_terminal needs num_steps >= 2 (got {num_steps})")
        sigmas = [r(1.0 - r(r(1.0 - s) / scale)) for s in sigmas]
    return [_f32(s) for s in sigmas] + [0.0]


def sigma_schedule(num_steps: int, shift: float) -> list[float]:
    """The schedule of a plain `FlowMatchEulerDiscreteScheduler(shift=shift)` run by `set_timesteps(N)`."""
    return flow_match_sigmas({"shift": shift}, num_steps)


def timestep_of(sigma: float) -> float:
    """The pipeline's timestep for a sigma: sigma * num_train_timesteps in float32."""
    return _f32(_f32(sigma) * NUM_TRAIN_TIMESTEPS)


def expert_index_for_step(sigmas: list[float], step: int, boundary_ratio: float | None) -> int:
    """0 for the high-noise expert (WanPipeline: t >= boundary_ratio * 1000), 1 for the low-noise one."""
    if boundary_ratio is None:
        return 0
    return 0 if timestep_of(sigmas[step]) >= boundary_ratio * NUM_TRAIN_TIMESTEPS else 1
