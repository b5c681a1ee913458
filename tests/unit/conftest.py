import os
import shutil
import tempfile
from unittest import mock

import pytest

from miles.testing.idle import IdleEnded
from miles.launcher.ray_auth import (
    own_cluster_auth,
    restore_this_process,
    use_in_this_process,
    write_fresh_token,
)
from miles.launcher.ray_cluster import NO_PRESTARTED_WORKERS_ENV
from miles.utils.numerics import pinned_env


# Modules whose tests mostly wait (on Ray heads of their own, on timeouts and grace periods they
# test, on inner pytest runs' quiet windows): run first, beside the CPU runs, whose half-dozen busy
# processes take the core they leave idle. Collected in path order they came last, together: the
# final 55 s of a 463 s suite with 0.3-0.9 of 2 cores busy, and later (with the launcher's module
# first) the last 40 s of a 499 s suite at 0.08-0.76, both workers waiting in tests/unit/testing.
WAIT_BOUND_FIRST = (
    "tests/unit/launcher/test_launch_real_ray.py",
    "tests/unit/testing/test_runner.py",
    "tests/unit/testing/test_runner_cleanup.py",
    "tests/unit/testing/test_plugin.py",
    "tests/unit/launcher/test_launch_processes.py",
    "tests/unit/ci/test_ci_run_suite.py",
    "tests/unit/ray/test_startup_failures.py",
    # dry checks in subprocesses, each a second of one process, that ended the suite with a core idle
    "tests/unit/testing/test_public_layout_recipe.py",
    "tests/unit/testing/test_recipe_checklist.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):  # the listed modules in the listed order, then the rest as collected
        return next((n for n, module in enumerate(WAIT_BOUND_FIRST) if item.nodeid.startswith(module)),
                    len(WAIT_BOUND_FIRST))

    items.sort(key=rank)


def _start_local_ray():
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # A token of this cluster's own, named to ray.init (which reads only the environment). Left
    # unnamed, a new local ray.init writes RAY_AUTH_MODE=token into os.environ and takes, or writes,
    # ~/.ray/auth_token: the user's home, and a token every later cluster of this worker would
    # inherit. Every other cluster names its own (ray_auth), so what this one leaves changes nothing.
    auth = own_cluster_auth(temp_dir, environ={})
    write_fresh_token(auth)
    saved_auth = use_in_this_process(auth)
    # no workers started ahead of demand, as on the launcher's nodes (ray_cluster.NO_PRESTARTED_WORKERS_ENV):
    # the tests' drivers and actors carry runtime envs of their own, so two idle workers a start were waste
    with mock.patch.dict(os.environ, NO_PRESTARTED_WORKERS_ENV):
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
                 # the pins named, not inherited: the actors compute as the tests' own process does
                 runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), **pinned_env()}})
    return ray, temp_dir, saved_auth


def _stop_local_ray(started) -> None:
    ray, temp_dir, saved_auth = started
    ray.shutdown()
    restore_this_process(saved_auth)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def worker_ray():
    """The test worker's in-process Ray cluster, with a temp dir of its own, as a service that ends
    while no test uses it (miles.testing.idle).

    One per worker because `ray.init` may run once per process at a time: two test modules that
    each started their own would fail whenever xdist put them on the same worker.
    """
    service = IdleEnded(_start_local_ray, _stop_local_ray,
                        wanted_by=lambda item: "local_ray" in item.fixturenames)
    yield service
    service.close()


@pytest.fixture
def local_ray(worker_ray):
    """The `ray` module, connected to the worker's in-process cluster for this test."""
    with worker_ray.using() as (ray, _, _):
        yield ray


@pytest.fixture(scope="session")
def tiny_checkpoint(model_cache_dir):
    """tiny_checkpoint(family="sd3", seed=0): the path of that tiny checkpoint, built on first use.

    In the harness's checkpoint cache (miles.testing.plugin.model_cache_dir), which every xdist
    worker and the recipes' e2e runs share: each checkpoint is built once per test run (sd3's VAE
    fit alone takes 12 s), and the builds are byte-identical whoever makes them."""
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.models.runtime import configure_torch

    configure_torch(num_threads=1)
    root = model_cache_dir
    return lambda family="sd3", seed=0: ensure_checkpoint(family, "tiny", seed, root)
