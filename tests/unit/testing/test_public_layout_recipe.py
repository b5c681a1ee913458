"""A user's launch script in miles-diffusion's public layout (public_layout_recipe.py, beside this
file), dropped unmodified into a sub-folder of scripts/ of a scratch copy of the repository: the
harness collects it as a dry case with no test edit, records its snapshot (its download included)
with --snapshot-update, and the snapshot then holds. The house-style test does not judge it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.testing.test_recipe_checklist import scratch_repo

REPO = Path(__file__).resolve().parents[3]
PUBLIC_RECIPE = Path(__file__).with_name("public_layout_recipe.py")
SNAPSHOT = "tests/e2e/__snapshots__/test_dry/test_dry[team.run_public_layout_demo-dry].txt"


def _scratch_repo(tmp_path: Path) -> Path:
    """A scratch copy of the catalog with the public-layout recipe dropped into scripts/team/."""
    root = scratch_repo(tmp_path)
    (root / "scripts" / "team").mkdir()
    shutil.copy(PUBLIC_RECIPE, root / "scripts" / "team" / "run_public_layout_demo.py")
    return root


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_", "WANDB_", "PYTEST_", "HF_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "tests/e2e", "-m", "dry", "-k", "public_layout",
                           "-p", "no:cacheprovider", "-q", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(180)
def test_a_public_layout_recipe_becomes_a_dry_case_whose_snapshot_shows_its_download(tmp_path):
    root = _scratch_repo(tmp_path)
    recorded = _pytest(root, "--snapshot-update")
    assert recorded.returncode == 0, recorded.stdout[-3000:]
    snapshot = (root / SNAPSHOT).read_text()
    assert "[prepare]\n$ hf download my-org/pickscore-prompts --revision main --repo-type dataset" in snapshot
    assert "--wandb-group run_public_layout_demo" in snapshot and "WANDB_API_KEY=<redacted>" in snapshot
    checked = _pytest(root)
    assert checked.returncode == 0 and "1 passed" in checked.stdout, checked.stdout[-3000:]
