import pytest

from dtype_helpers import MODEL_DIR_ENV


@pytest.fixture(autouse=True)
def shared_checkpoint_cache(model_cache_dir, monkeypatch):
    """dtype_helpers builds and reads its tiny checkpoints in the session's checkpoint cache, named
    in the environment so that the ranks a test spawns read the same one."""
    monkeypatch.setenv(MODEL_DIR_ENV, str(model_cache_dir))
