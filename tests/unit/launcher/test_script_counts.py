"""A recipe's own counts and seeds checked by name before prepare() (miles.launcher.config)."""

from dataclasses import dataclass

import pytest

from miles.launcher.config import ScriptOptionError, check_script_counts


@dataclass
class Ours:
    num_rollout: int | None = None
    train_ranks: int = 1
    seed: int = 0


@dataclass
class UpstreamNft:
    num_rollout: int = 0  # miles-diffusion's NFT scripts: 0 picks the smoke/full default


@pytest.mark.parametrize("options, flag", [(Ours(train_ranks=0), "--train-ranks"), (Ours(num_rollout=0), "--num-rollout"),
                                           (Ours(seed=-5), "--seed"), (UpstreamNft(num_rollout=-1), "--num-rollout")])
def test_a_count_below_its_floor_is_refused_naming_the_scripts_flag(options, flag):
    with pytest.raises(ScriptOptionError, match=rf"^{flag}: must be >= \d( \(a seed\))?, got {flag} -?\d+; fix: "):
        check_script_counts(options)


def test_a_script_whose_own_default_count_is_0_keeps_0_as_its_default():
    check_script_counts(UpstreamNft())  # the script resolves 0 itself (`args.num_rollout or 100`)
