"""miles.utils.schedule builds the same float32 sigmas as FlowMatchEulerDiscreteScheduler, bit for bit."""

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler

from miles.utils.schedule import calculate_shift, expert_index_for_step, flow_match_config, flow_match_sigmas

CONFIGS = [
    dict(shift=3.0), dict(shift=12.0), dict(shift=3.1), dict(shift=3.0, shift_terminal=0.05),
    dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02),
    dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, shift_terminal=0.1),
    dict(use_dynamic_shifting=True, time_shift_type="linear"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("linspace_sigmas", [False, True])
def test_sigmas_equal_the_schedulers(config, linspace_sigmas):
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    for num_steps in (2, 3, 7, 10, 28, 50):
        for seq_len in (16, 3000):
            mu = calculate_shift(seq_len, dict(scheduler.config)) if config.get("use_dynamic_shifting") else None
            kwargs = {} if mu is None else {"mu": mu}
            if linspace_sigmas:
                scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), **kwargs)
            else:
                scheduler.set_timesteps(num_steps, **kwargs)
            ours = flow_match_sigmas(dict(scheduler.config), num_steps, linspace_sigmas=linspace_sigmas, mu=mu)
            assert ours == scheduler.sigmas.tolist()


def test_wan_expert_choice_follows_the_pipelines_float32_timestep():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=12.0)
    for num_steps in range(1, 120):
        scheduler.set_timesteps(num_steps)
        sigmas = flow_match_sigmas({"shift": 12.0}, num_steps)
        want = [0 if t >= 875.0 else 1 for t in scheduler.timesteps.tolist()]
        assert [expert_index_for_step(sigmas, k, 0.875) for k in range(num_steps)] == want


def test_a_flow_shift_scheduler_runs_as_flow_match_euler_with_that_shift():
    unipc = {"_class_name": "UniPCMultistepScheduler", "flow_shift": 5.0, "use_flow_sigmas": True}
    assert flow_match_config(unipc)["shift"] == 5.0
    with pytest.raises(ValueError, match="not a flow-matching"):
        flow_match_config({"_class_name": "DDIMScheduler"})
