import random
from types import SimpleNamespace

import pytest

from miles.rollout.step_strategy import (
    epoch_global_random_choice,
    resolve_step_strategy,
    sde_window,
    trained_steps_for_rollout,
)


def _args(**kw):
    base = dict(diffusion_num_steps=10, diffusion_num_sde_steps=3, diffusion_sde_window_max_start=4,
                diffusion_step_strategy_path="sde_window", rollout_seed=42)
    return SimpleNamespace(**{**base, **kw})


def test_sde_window_is_contiguous_and_starts_anywhere_up_to_the_max_start():
    starts = set()
    for rollout_id in range(200):
        steps = trained_steps_for_rollout(_args(), rollout_id)
        assert steps == list(range(steps[0], steps[0] + 3))
        starts.add(steps[0])
    assert starts == {0, 1, 2, 3, 4}


def test_sde_window_with_max_start_zero_is_the_first_steps():
    assert trained_steps_for_rollout(_args(diffusion_sde_window_max_start=0), 7) == [0, 1, 2]


def test_sde_window_that_does_not_fit_is_an_error():
    with pytest.raises(ValueError, match="exceeds 10 steps"):
        sde_window(_args(diffusion_sde_window_max_start=8), 0, 10, 3, random.Random(0))


def test_epoch_global_random_choice_draws_distinct_steps_reproducibly():
    args = _args(diffusion_step_strategy_path="epoch_global_random_choice", diffusion_num_sde_steps=4)
    picks = [trained_steps_for_rollout(args, r) for r in range(20)]
    assert all(len(set(p)) == 4 and p == sorted(p) and all(0 <= s < 10 for s in p) for p in picks)
    assert picks == [trained_steps_for_rollout(args, r) for r in range(20)]
    assert len({tuple(p) for p in picks}) > 5
    assert epoch_global_random_choice(args, 0, 10, 10, random.Random(1)) == list(range(10))


def test_all_steps_are_trained_when_num_sde_steps_is_unset():
    assert trained_steps_for_rollout(_args(diffusion_num_sde_steps=None, diffusion_sde_window_max_start=0), 3) == list(range(10))


def last_two(args, rollout_id, num_steps, num_sde_steps, rng):
    return [num_steps - 2, num_steps - 1]


def out_of_range(args, rollout_id, num_steps, num_sde_steps, rng):
    return [num_steps]


@pytest.mark.parametrize("sep", [":", "."])
def test_a_dotted_path_names_a_custom_strategy(sep):
    path = f"{__name__}{sep}last_two"
    assert resolve_step_strategy(path) is last_two
    assert trained_steps_for_rollout(_args(diffusion_step_strategy_path=path), 0) == [8, 9]


def test_a_custom_strategy_returning_bad_steps_is_rejected():
    with pytest.raises(ValueError, match="want distinct steps"):
        trained_steps_for_rollout(_args(diffusion_step_strategy_path=f"{__name__}:out_of_range"), 0)


def test_sde_window_min_start_keeps_every_window_inside_the_range_and_zero_draws_as_before():
    starts = {trained_steps_for_rollout(_args(diffusion_sde_window_min_start=3), r)[0] for r in range(200)}
    assert starts == {3, 4}
    # a min start of 0 is the strategy as it was: the same window for every seed
    for rollout_id in range(50):
        assert (trained_steps_for_rollout(_args(diffusion_sde_window_min_start=0), rollout_id)
                == trained_steps_for_rollout(_args(), rollout_id))


def test_epoch_global_random_choice_draws_only_the_candidate_steps():
    args = _args(diffusion_step_strategy_path="epoch_global_random_choice", diffusion_num_sde_steps=2,
                 diffusion_sde_candidate_steps=[1, 2, 3], diffusion_timestep_fraction=0.99)
    picks = [tuple(trained_steps_for_rollout(args, r)) for r in range(100)]
    assert set(picks) == {(1, 2), (1, 3), (2, 3)}  # every pair of candidates comes up, nothing else
    without = _args(diffusion_step_strategy_path="epoch_global_random_choice", diffusion_num_sde_steps=2,
                    diffusion_timestep_fraction=0.99)
    assert {s for r in range(100) for s in trained_steps_for_rollout(without, r)} - {1, 2, 3}
