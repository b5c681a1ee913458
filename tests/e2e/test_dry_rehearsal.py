"""Dry checks of each GPU case beside its rehearsal (issue 39): the settings a rehearsal does not
share with its GPU case, printed (miles/testing/rehearsal.py); a difference not in ACCEPTED, with
its reason, fails. Ideally the only difference is the device.
"""

from pathlib import Path

import pytest

from miles.testing.rehearsal import THE_DEVICE, differences, rehearsal_pairs, report

pytestmark = [pytest.mark.e2e, pytest.mark.dry]

def _recipe_cases() -> list:
    """Every recipe test module's CASES (tests/e2e/test_*.py), imported by path."""
    import importlib.util

    cases = []
    for path in sorted(p for p in Path(__file__).parent.glob("test_*.py") if not p.name.startswith("test_dry")):
        spec = importlib.util.spec_from_file_location(f"_cases_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cases += list(getattr(module, "CASES", []))
    return cases


# what a rehearsal does not share with its GPU case beyond the device, and why (issue 39, point 3).
# A recipe whose rehearsal drifts from its GPU case (a setting on one side only) fails here until the
# rehearsal follows, or the difference is listed with its reason.
GPU_TILE = ("the GPU case's micro-batch tile needs that many samples per optimizer step and rank: 2-4x the CPU "
            "proxy's samples; the rehearsal keeps the CPU tier's tile of 2, whose train forwards are the engines' "
            "microgroups all the same (--rollout-microgroup-size follows the tile on both)")
TILED = {"micro_batch_size_sample": GPU_TILE, "rollout_microgroup_size": GPU_TILE}
FULL_RUN = {
    "deterministic_mode": "the full run samples with nondeterministic kernels (FULL_SCALE); parity 0.0 needs none, "
                          "but the rehearsal's metric standard does",
    "stop_on_parity_drift": "the flag belongs to the test cases (GPU tier and rehearsal), not to the recipe's own run",
}
ACCEPTED: dict[str, dict[str, str]] = {
    "run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu-cpu-rehearsal": TILED,
    "run_diffusion_grpo_pickscore_5gpu_flowgrpo_aligned-cpu-rehearsal": TILED,
    "run_diffusion_grpo_sd3_ocr_sglang-cpu-rehearsal": TILED,
    "run_diffusion_nft_sd3_pickscore-cpu-rehearsal": TILED,
    "run_diffusion_grpo_wan22_pickscore_17gpu_multinode-cpu-rehearsal-fsdp": FULL_RUN,
}


@pytest.mark.parametrize("pair", rehearsal_pairs(_recipe_cases()), ids=lambda p: f"{p[0].name}~{p[1].name}")
def test_a_rehearsal_shares_every_setting_of_its_gpu_case_but_the_device(pair, dry_run):
    gpu_case, rehearsal_case = pair
    gpu, rehearsal = dry_run(gpu_case), dry_run(rehearsal_case)
    diff = differences(gpu.argv, rehearsal.argv)
    print(report(gpu_case, rehearsal_case, diff))
    assert set(diff) - THE_DEVICE == set(ACCEPTED.get(rehearsal_case.name, {})), report(gpu_case, rehearsal_case, diff)
