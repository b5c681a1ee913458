# Registers the recipe test harness for this repository. Other repositories load it with
# `pytest -p miles.testing`.
from miles.utils.numerics import pin_this_process

# The tests' own processes compute too (in-process forwards, bf16 matmuls, checkpoints): they get
# the same pinned numerics as every run (docs/testing.md, "Portable verdicts"), before any test
# module imports torch; xdist workers inherit the pinned environment.
pin_this_process()

pytest_plugins = ["miles.testing"]
