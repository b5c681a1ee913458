# Registers the recipe test harness for this repository. Other repositories load it with
# `pytest -p miles.testing`.
import os

import pytest

from miles.utils.import_cost import collector_paused
from miles.utils.numerics import pin_environ, pin_this_process

# The tests' own processes compute too (in-process forwards, bf16 matmuls, checkpoints): they get
# the same pinned numerics as every run (docs/testing.md, "Portable verdicts"), before any test
# module imports torch; xdist workers inherit the pinned environment.
pin_this_process()

pytest_plugins = ["miles.testing"]


@pytest.fixture(autouse=True)
def pinned_environment_kept():
    """The pins stay in this process's environment whatever a test runs in it. An in-process
    `train_diffusion.main()` of a GPU command unpins os.environ, as a GPU run's driver must; a Ray
    cluster this worker started afterwards then gave its actors AVX-512 kernels on an AVX-512 host
    while the tests' own process computed with AVX2, and an actor-vs-local bit comparison failed."""
    yield
    pin_environ(os.environ)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collection imports every test module, and through them torch and the model libraries: with
    the cyclic collector paused meanwhile, as the model loader pauses it (miles.utils.import_cost)."""
    with collector_paused():
        yield
