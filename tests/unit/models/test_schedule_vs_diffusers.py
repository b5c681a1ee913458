"""miles.diffusion_facts.schedule builds the same float32 sigmas as FlowMatchEulerDiscreteScheduler, bit for bit."""

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler

from miles.diffusion_facts.schedule import (
    calculate_shift, edm_flow_sigmas, expert_index_for_step, flow_match_config, flow_match_sigmas,
)

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


COSMOS2 = {"num_train_timesteps": 1000, "shift": 1.0, "use_karras_sigmas": True, "sigma_min": 0.002,
           "sigma_max": 80.0, "sigma_data": 1.0, "final_sigmas_type": "sigma_min"}


@pytest.mark.parametrize("config", [COSMOS2, {**COSMOS2, "sigma_max": 200.0, "sigma_min": 0.01},
                                    {**COSMOS2, "final_sigmas_type": "zero"}])
def test_edm_times_are_the_cosmos2_pipelines(config):
    import torch

    for num_steps in (1, 2, 3, 7, 10, 35):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        # Cosmos2TextToImagePipeline.__call__, step 4
        scheduler.set_timesteps(sigmas=torch.linspace(0, 1, num_steps, dtype=torch.float64).numpy())
        if scheduler.config.get("final_sigmas_type", "zero") == "sigma_min":
            scheduler.sigmas[-1] = scheduler.sigmas[-2]
        want = (scheduler.sigmas / (scheduler.sigmas + 1)).tolist()  # the pipeline's current_t, float32
        assert edm_flow_sigmas(config, num_steps) == want


def test_an_edm_family_refuses_a_scheduler_without_karras_sigmas():
    with pytest.raises(ValueError, match="needs use_karras_sigmas and sigma_min/sigma_max"):
        flow_match_config({"shift": 3.0}, edm=True)
    with pytest.raises(ValueError, match="not supported by the flow-matching sampler"):
        flow_match_config(COSMOS2)  # a flow family cannot run EDM sigmas
