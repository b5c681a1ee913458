import textwrap
from argparse import Namespace

import pytest

CUSTOM_REWARDS = '''
import math

async def raises(args, samples):
    for s in samples:
        if "bad" in s.prompt:
            raise ValueError("cannot read this one")
    return [1.0] * len(samples)

async def returns_nan(args, samples):
    return [math.nan if "bad" in s.prompt else 0.5 for s in samples]

async def too_few(args, samples):
    return [1.0] * (len(samples) - 1)

async def prompt_length(args, samples):
    return [{"len": float(len(s.prompt)), "other": 0.0} for s in samples]

def sync_constant(args, samples):
    return [0.25 for _ in samples]

async def returns_float(args, samples):
    return 0.5
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """An importable module `my_rewards` holding the custom rewards above."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(CUSTOM_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def _make_args(**overrides):
    base = dict(rm_type=None, custom_rm_path=None, reward_key=None, reward_timeout=300,
                pickscore_model_path=None, rm_num_workers=1, rm_num_gpus_per_worker=0.0, colocate_reward=False)
    base.update(overrides)
    return Namespace(**base)


@pytest.fixture
def make_args():
    """A trainer-like Namespace with the reward flags at their defaults, overridable."""
    return _make_args
