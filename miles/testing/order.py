"""The order an xdist run hands its tests out in: the recipe runs spread through the session.

pytest-xdist's `load` scheduling (what `-n N` uses) gives each worker a contiguous run of the
collection to start with, then refills whichever worker runs short, again in collection order.
Collected in path order, the recipe runs (tens of seconds each, most of a session's time) sit
together, so one worker's first chunk held all of them and the other worker ran out of tests:
116 s of a 548 s session with one of two workers idle (this machine, 2 cores). Spread evenly
through the first part of the order, every chunk carries its share of them, and the session ends
on short tests that refill whichever worker is free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# the tail of the order that holds no long run: short tests that balance the workers' last chunks
SHORT_TAIL = 0.25


def spread_long(items: Sequence[T], cost: Callable[[T], float]) -> list[T]:
    """`items` with those of positive `cost` spread evenly over the first 1 - SHORT_TAIL of the
    others, longest first; the others keep their order, and so do long items of equal cost."""
    long = sorted((item for item in items if cost(item) > 0), key=cost, reverse=True)
    short = [item for item in items if not cost(item) > 0]
    if not long or not short:
        return list(items)
    span = (1.0 - SHORT_TAIL) * len(short)
    # long item i goes before short item slot(i): the middles of len(long) equal slices of the span
    slots = [int((i + 0.5) * span / len(long)) for i in range(len(long))]
    ordered: list[T] = []
    pending = iter(long)
    for index, item in enumerate(short):
        ordered += [next(pending) for slot in slots if slot == index]
        ordered.append(item)
    ordered += list(pending)
    return ordered
