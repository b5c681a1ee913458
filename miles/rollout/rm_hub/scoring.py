"""`score_samples`: one reward per sample, called in batches, its answers checked.

A run must never train on a reward that silently failed, so every value is checked here and a
bad one stops the run with the reward's name and the sample it failed on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any

from miles.rollout.rm_hub.registry import resolve, reward_name
from miles.rollout.rm_hub.types import RewardError, RewardFn, RewardSample
from miles.flags.reward_names import BUILTIN_REWARDS

# what a reward must return, as the custom loss's errors state theirs (miles.utils.dotted_path)
MUST_RETURN = "one score per sample, in order: a list of floats (`async def rm(args, samples) -> list[float]`)"


def describe(index: int, sample: RewardSample) -> str:
    return f"sample {index} (prompt {sample.prompt!r})"


def who(args: Any, name: str) -> str:
    """The reward as the user gave it: `--custom-rm-path pkg.mod:fn`, or the built-in's or metadata's name."""
    if name == getattr(args, "custom_rm_path", None):
        return f"--custom-rm-path {name}"
    return f"reward {name!r}" if name in BUILTIN_REWARDS else f"reward {name!r} (a prompt's metadata rm_type)"


async def _call(fn: RewardFn, args: Any, samples: list[RewardSample]) -> Any:
    result = fn(args, samples)
    return await result if inspect.isawaitable(result) else result


def _to_float(value: Any, reward_key: str | None, name: str, where: str) -> float:
    if isinstance(value, dict):
        keys = ", ".join(map(str, value))
        if reward_key is None:
            raise RewardError(f"{name} returned a dict for {where}; fix: pick its score with --reward-key "
                              f"(keys: {keys})")
        if reward_key not in value:
            raise RewardError(f"{name} returned no key {reward_key!r} (--reward-key) for {where}; fix: --reward-key "
                              f"one of {keys}")
        value = value[reward_key]
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"{name} returned {value!r}, not a number, for {where}; fix: return {MUST_RETURN}") from None
    if not math.isfinite(number):
        raise RewardError(f"{name} returned {number} for {where}; fix: return a finite score for every sample")
    return number


async def _find_culprit(fn: RewardFn, args: Any, samples: list[RewardSample], indices: list[int]) -> int | None:
    """The first sample that makes the reward raise on its own, to name it in the error."""
    for index, sample in zip(indices, samples):
        try:
            await _call(fn, args, [sample])
        except Exception:
            return index
    return None


async def _run_group(args: Any, name: str, samples: list[RewardSample], indices: list[int]) -> list[float]:
    fn = resolve(name)
    timeout = getattr(args, "reward_timeout", None)
    name = who(args, name)
    try:
        values = await asyncio.wait_for(_call(fn, args, samples), timeout)
    except RewardError:
        raise
    except asyncio.TimeoutError:
        raise RewardError(f"{name} timed out after {timeout}s on samples {indices[0]}..{indices[-1]} "
                          f"(first prompt {samples[0].prompt!r}); fix: a larger --reward-timeout, or a faster "
                          f"reward") from None
    except Exception as err:
        culprit = indices[0] if len(samples) == 1 else await _find_culprit(fn, args, samples, indices)
        where = (describe(culprit, samples[indices.index(culprit)]) if culprit is not None
                 else f"samples {indices[0]}..{indices[-1]} (first prompt {samples[0].prompt!r})")
        raise RewardError(f"{name} raised {type(err).__name__}: {err} on {where}; fix: that function, which "
                          f"must return {MUST_RETURN}") from err
    span = f"samples {indices[0]}..{indices[-1]}, first: {describe(indices[0], samples[0])}"
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardError(f"{name} returned a {type(values).__name__} ({span}); fix: return {MUST_RETURN}")
    values = list(values)
    if len(values) != len(samples):
        raise RewardError(f"{name} returned {len(values)} values for {len(samples)} samples ({span}); fix: return "
                          f"{MUST_RETURN}")
    reward_key = getattr(args, "reward_key", None)
    return [_to_float(v, reward_key, name, describe(i, s)) for v, i, s in zip(values, indices, samples)]


def group_by_reward(args: Any, samples: list[RewardSample], first_index: int = 0) -> dict[str, list[int]]:
    """Reward name -> positions (in `samples`) of the samples it scores, in order."""
    groups: dict[str, list[int]] = {}
    for position, sample in enumerate(samples):
        try:
            name = reward_name(args, sample.metadata or {})
            resolve(name)
        except RewardError as err:
            raise RewardError(f"{err} ({describe(first_index + position, sample)})") from None
        groups.setdefault(name, []).append(position)
    return groups


async def score_samples(args: Any, samples: list[RewardSample], *, first_index: int = 0) -> list[float]:
    """One float per sample, in order. `first_index` offsets the sample numbers in error messages
    (a reward worker scoring a slice of the batch names samples by their place in the batch)."""
    groups = group_by_reward(args, samples, first_index)
    results = await asyncio.gather(*(
        _run_group(args, name, [samples[p] for p in positions], [first_index + p for p in positions])
        for name, positions in groups.items()
    ))
    scores = [0.0] * len(samples)
    for positions, values in zip(groups.values(), results):
        for position, value in zip(positions, values):
            scores[position] = value
    return scores
