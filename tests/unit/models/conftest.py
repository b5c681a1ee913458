import os

import pytest

from miles.models.create_checkpoint import ensure_checkpoint
from miles.models.runtime import configure_torch



@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """family -> path of its tiny seed-0 checkpoint, built once (shared by xdist workers)."""
    configure_torch(num_threads=1)
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "miles-tiny-checkpoints"
    return lambda family: ensure_checkpoint(family, "tiny", 0, root)
