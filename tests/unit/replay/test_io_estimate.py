"""miles.replay.io_estimate: push time per rollout and save stall per checkpoint, before and after
issue 41, from the plan's bytes and documented rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.replay.io_estimate import GLOO_GBPS, main, recipe_estimate

REPO = Path(__file__).resolve().parents[3]


def test_wan22_17gpu_pushes_both_experts_in_bf16_device_to_device_and_saves_without_waiting_for_the_disk():
    est = recipe_estimate(REPO / "scripts/run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py")
    # issue 41: one A14B expert in bfloat16 is 28.6 GB, both are pushed
    assert est.update_gb == pytest.approx(2 * 28.6, rel=0.01)
    assert est.colocated and est.push_before_s[1] >= est.update_gb / GLOO_GBPS[0]
    assert est.push_after_s * 10 < est.push_before_s[0]  # the host path was the bottleneck
    assert est.stall_after_s * 10 < est.stall_before_s and est.node_write_s > est.stall_after_s


def test_an_sft_recipe_has_no_push_and_every_gpu_recipe_prints_both_figures(capsys):
    assert recipe_estimate(REPO / "scripts/run_diffusion_sft_wan22.py").update_gb == 0.0
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.count("  save stall per checkpoint: ") == out.count("  push per rollout: ") >= 7
    assert "run_diffusion_grpo_wan22_pickscore_17gpu_multinode.py" in out
