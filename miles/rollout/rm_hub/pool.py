"""Scoring in process, and how samples are dealt out to reward workers.

`LocalRewardScorer` offers the same `score(samples) -> list[float]` (and `ascore` for callers
inside an event loop) as the pool of Ray actors in `miles.ray.reward_pool`, so tests and the
`score` command use it where no Ray cluster runs. The pool deals samples out in contiguous slices
(`split_evenly`), one per worker, and puts the answers back in the original order.
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.rollout.rm_hub.scoring import score_samples
from miles.rollout.rm_hub.types import RewardSample



def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (start, stop) slices of range(count), sizes differing by at most one, empty ones dropped."""
    base, extra = divmod(count, parts)
    slices, start = [], 0
    for part in range(parts):
        stop = start + base + (part < extra)
        if stop > start:
            slices.append((start, stop))
        start = stop
    return slices


def _run(coroutine) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    coroutine.close()
    raise RuntimeError("score() called inside a running event loop; await ascore() instead")


class LocalRewardScorer:
    """Scores in this process: for tests, the `score` command and single-process debugging."""

    def __init__(self, args: Any) -> None:
        self.args = args

    async def ascore(self, samples: list[RewardSample]) -> list[float]:
        return await score_samples(self.args, samples)

    def score(self, samples: list[RewardSample]) -> list[float]:
        return _run(self.ascore(samples))

    def shutdown(self) -> None:
        pass
