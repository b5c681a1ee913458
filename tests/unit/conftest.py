import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def local_ray():
    """One in-process Ray cluster per test worker, with a temp dir of its own.

    Shared because `ray.init` may run once per process: two test modules that each started their
    own would fail whenever xdist put them on the same worker.
    """
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # Explicitly off: otherwise ray.init, finding ~/.ray/auth_token, turns token auth on by writing
    # RAY_AUTH_MODE=token into this process's os.environ, and every cluster a later test of this
    # worker starts inherits it; our loopback clients then get "Missing authentication token" and
    # see no nodes (the "second node never reported alive under the full suite" failures).
    previous_auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
    if previous_auth_mode is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = previous_auth_mode
    shutil.rmtree(temp_dir, ignore_errors=True)


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
