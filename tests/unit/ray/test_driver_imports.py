"""What the run's driver process imports: it places actors and handles rewards and metadata, so it
needs torch (the rollout's tensors) but no model library. Every run starts one driver; a model
library imported there is paid again on every run (transformers alone is about 1 CPU-s)."""

import subprocess
import sys

MODEL_LIBRARIES = ("transformers", "tokenizers", "diffusers", "peft")


def test_the_driver_imports_its_actor_classes_without_a_model_library():
    # what train_diffusion's _train_placed imports
    code = ("import sys\n"
            "from miles.ray import faults, parity_drift, rollout_manager, checkpoint_saver, train_actor_group\n"
            "from miles.ray import weight_sync_group\n"
            "from miles.records import checkpoint_identity, run_logging\n"
            "from miles.backends import sft\n"
            f"print(sorted(m for m in {MODEL_LIBRARIES!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"the driver's imports pull in {out.strip()}"
