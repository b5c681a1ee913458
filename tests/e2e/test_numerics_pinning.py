"""The project pins CPU numerics where runs start (miles/utils/numerics.py), not the user's shell:
the tiny recipe's CPU case reproduces its committed standard bit for bit whatever the shell says
about kernel levels, MKL's code path or thread counts.

The variant is the tiny recipe's own CPU case run under a hostile environment and compared with
the same committed standard, strictly, so it and the plain case agree bit for bit.
"""

import pytest

from miles.testing import parametrize_cases

from test_grpo_tiny_cpu import CASES as TINY_CASES

TINY_CPU = next(c for c in TINY_CASES if c.tier == "cpu")

# Every pinned setting set against the pin at once: an older CPU as torch would see it, MKL's
# compatible path and AVX-512 instructions, oneDNN at any ISA, more threads than pinned, and
# numpy's loops all enabled. One run: the pins are set whatever the value they replace (one
# assignment each, miles/utils/numerics.py), so a second shell with other wrong values proved
# nothing more and cost an own-head run of 40 s.
HOSTILE_SHELLS = {
    "hostile": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                "ONEDNN_MAX_CPU_ISA": "ALL", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                "NPY_DISABLE_CPU_FEATURES": ""},
}

CASES = [TINY_CPU.with_(variant=f"shell-{name}", env=env, est_time=TINY_CPU.est_time)
         for name, env in HOSTILE_SHELLS.items()]


@parametrize_cases(CASES)
def test_tiny_recipe_reproduces_its_standard_under_a_hostile_shell(recipe_case, run_recipe, check_run, request):
    run = run_recipe(recipe_case)
    fingerprint = run.run_json["fingerprint"]
    assert fingerprint["torch_cpu_capability"] == "AVX2"
    assert fingerprint["torch_threads"] == 1
    assert fingerprint["numerics"]["ATEN_CPU_CAPABILITY"] == "avx2"
    # the tiny case's own standard, not one of this variant's
    check_run(run, standard_case=TINY_CPU)
