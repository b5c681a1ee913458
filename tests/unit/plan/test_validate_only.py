"""`python3 train_diffusion.py --validate-only`, as a user runs it, and `main()` in process."""

from __future__ import annotations

import functools
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import train_diffusion

REPO = Path(__file__).resolve().parents[3]
BASE = ["--hf-checkpoint", "/ckpt/qwen-image", "--num-rollout", "2", "--rm-type", "pickscore",
        "--prompt-data", "prompts.jsonl"]
# DESIGN section 4: 32 prompts x 16 samples, 2 SDE steps, 4 DP ranks, 2 steps per rollout, 8 x 1 tile
# (the engines sample in microgroups of those 8, so each train forward is one they ran).
WORKED = BASE + ["--rollout-batch-size", "32", "--n-samples-per-prompt", "16", "--diffusion-num-sde-steps", "2",
                 "--actor-num-gpus-per-node", "4", "--colocate", "--num-steps-per-rollout", "2",
                 "--micro-batch-size-sample", "8", "--micro-batch-size-tstep", "1", "--rollout-microgroup-size", "8"]
WAN = ["--hf-checkpoint", "/ckpt/wan2.2-tiny", "--num-rollout", "2", "--rm-type", "pickscore",
       "--prompt-data", "prompts.jsonl", "--diffusion-guidance-scale-2", "3.0"]
# CPU seconds, not wall time: the machine is shared, and CPU time is what the parse path costs;
# counted above a bare interpreter's start, measured in the same run, so the bound is about our
# imports and not the machine. Measured on an AMD EPYC of CI's kind: a bare start 0.04-0.05 s, the
# parse path 0.21-0.28 s above it, `import ray` 0.73 s above it (torch 1.9 s). 0.5 s leaves the
# parse path about twice its cost and still fails any heavy import. (A flat 0.3 s including the
# interpreter's start was read off a faster CPU: --help cost 0.26-0.32 s on the AMD one, idle.)
CPU_BUDGET_S = 0.5


def _child_cpu(argv: list[str], **kw) -> tuple[subprocess.CompletedProcess, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@functools.cache
def bare_interpreter_cpu() -> float:
    return min(_child_cpu([sys.executable, "-c", "pass"])[1] for _ in range(3))


def run_cli(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI's result and the CPU seconds it took beyond a bare interpreter's start."""
    result, cpu = _child_cpu([sys.executable, "train_diffusion.py", *argv], cwd=REPO)
    return result, cpu - bare_interpreter_cpu()


def plan_value(table: str, label: str) -> str:
    for line in table.splitlines():
        if line.strip().startswith(label + "  "):
            return line.strip()[len(label):].split()[0]
    raise AssertionError(f"{label!r} not in\n{table}")


def test_worked_example_prints_the_documented_counts_and_exits_0():
    result, cpu = run_cli(["--validate-only", *WORKED])
    assert result.returncode == 0, result.stderr
    figures = {label: plan_value(result.stdout, label) for label in (
        "samples per rollout", "train pairs", "dp size", "pairs per rank", "pairs per optimizer step per rank",
        "pairs per forward", "forwards per optimizer step")}
    assert figures == {"samples per rollout": "512", "train pairs": "1024", "dp size": "4",
                       "pairs per rank": "256", "pairs per optimizer step per rank": "128",
                       "pairs per forward": "8", "forwards per optimizer step": "16"}
    assert cpu < CPU_BUDGET_S


ERROR_CASES = {
    "pair shard rule": (WORKED + ["--num-steps-per-rollout", "3"],
                        "num_pairs_shard=256 not divisible by num_steps_per_rollout=3; fix:"),
    "Wan2.2 expert boundary": (WAN + ["--diffusion-num-steps", "8", "--micro-batch-size", "2"],
                               "Micro-batch mixes denoising phases (Wan2.2)"),
    "contradicting batch knobs": (BASE + ["--global-batch-size", "64", "--num-steps-per-rollout", "2"],
                                  "--global-batch-size 64 x --num-steps-per-rollout 2 = 128 contradicts"),
    "global batch vs dp": (WORKED + ["--global-batch-size", "2", "--num-steps-per-rollout", "256"],
                           "global_batch_size=2 not divisible by dp_size=4"),
    "too many GPUs": (BASE + ["--actor-num-gpus-per-node", "8", "--rm-num-gpus-per-worker", "1"],
                      "the GPU layout needs 10 GPUs"),
    "save interval without save": (BASE + ["--save-interval", "10"], "--save-interval 10 needs --save"),
    "micro-batch that is no engine forward": (
        WORKED + ["--rollout-microgroup-size", "16"],
        "cannot reproduce the engines' forwards: a forward would hold samples [0, 1, 2, '...'], not microgroup "
        "0's 16 samples 0..15, and each train forward must be one microgroup of --rollout-microgroup-size 16"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_error_case_exits_1_with_its_one_line_message_quickly(case):
    argv, message = ERROR_CASES[case]
    result, cpu = run_cli(["--validate-only", *argv])
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "fix" in lines[0]
    assert cpu < CPU_BUDGET_S


def test_unknown_flag_exits_2_with_the_closest_flag():
    result, cpu = run_cli(["--validate-only", *BASE, "--colocat"])
    assert result.returncode == 2
    assert "unrecognized arguments: --colocat (did you mean --colocate?)" in result.stderr
    assert cpu < CPU_BUDGET_S


def test_help_exits_0_within_the_budget():
    result, cpu = run_cli(["--help"])
    assert result.returncode == 0 and "--validate-only" in result.stdout
    assert cpu < CPU_BUDGET_S


# ---- main() in process ----

def test_main_returns_0_after_validate_only(capsys):
    assert train_diffusion.main(["--validate-only", *WORKED]) == 0
    assert "forwards per optimizer step" in capsys.readouterr().out


def test_main_returns_1_on_a_config_error(capsys):
    assert train_diffusion.main(BASE + ["--save-interval", "3"]) == 1
    assert "needs --save" in capsys.readouterr().err


def test_main_returns_2_on_an_argparse_error(capsys):
    assert train_diffusion.main(BASE + ["--no-such-flag"]) == 2


def test_real_run_prints_the_plan_then_trains_with_the_validated_args(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(train_diffusion, "train", lambda args, plan: calls.append((args, plan)) or 7)
    # the worked example's Qwen-Image checkpoint is not on this machine: the file checks that a real
    # run makes before Ray (refuse_bad_files) are the bad-input sweep's and test_preflight's to show
    monkeypatch.setattr(train_diffusion, "refuse_bad_files", lambda args: None)
    assert train_diffusion.main(WORKED) == 7
    (args, plan), = calls
    assert (args.global_batch_size, args.diffusion_model_family) == (256, "qwen_image")
    assert plan.forwards_per_step == 16
    assert plan.table() in capsys.readouterr().out
