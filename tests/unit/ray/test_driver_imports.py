"""The trainer's driver starts its actors without loading the model libraries itself: everything
train_diffusion.py imports before the first actor exists leaves transformers, diffusers and PEFT
unimported (each is seconds of a loaded machine's start-up, on the path before any actor starts)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
MODEL_LIBRARIES = ("transformers", "diffusers", "peft")


def test_the_driver_imports_no_model_library():
    # the imports of train_diffusion.train(), in a fresh interpreter
    code = (
        "import sys, train_diffusion, ray, torch\n"
        "from miles.backends import checkpoint\n"
        "from miles.ray import faults\n"
        "from miles.utils import checkpoint_identity\n"
        "from miles.utils.run_logging import MetricsLogger\n"
        "from miles.backends.sft import SFTSource\n"
        "from miles.ray.placement import place_run\n"
        "from miles.ray.rollout_manager import RolloutManager\n"
        "from miles.ray.train_actor_group import TrainActorGroup\n"
        "from miles.ray.weight_sync_group import connect_weight_sync\n"
        f"print(sorted(m for m in {MODEL_LIBRARIES!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
