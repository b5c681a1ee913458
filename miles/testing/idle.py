"""Session services that end while no test needs them, and start again for the next one that does.

A test worker's Ray cluster is wanted by a few tests of its session and waits through the rest:
an idle loopback head with its job server takes 12-28 % of a core (measured on different days),
an in-process `ray.init` cluster 18 %, on the 2-core machines CI runs on. A service here is ended
at the start of a test that does not want it, once it has waited `IDLE_S`; a later test that
wants it starts it again.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, TypeVar

import pytest

T = TypeVar("T")

# Ending early costs a restart, waiting costs the idle cluster's share of a core. A restart is
# 5 CPU-s (`ray.init`) to 6-8.5 CPU-s (a head with its job server), idle is 12-28 % of a core:
# the two break even after 20-70 s of waiting. Waiting that long before ending costs at most
# twice the better choice made with hindsight (the ski-rental bound); 30 s is near the middle.
IDLE_S = 30.0

_SERVICES: "weakref.WeakSet[IdleEnded]" = weakref.WeakSet()


class IdleEnded(Generic[T]):
    """`start()` makes the service's value, `stop(value)` ends it. `using()` holds it for a block,
    starting it first if it is not running; `wanted_by(item)` says whether a test will use it
    (such a test never ends it first)."""

    def __init__(self, start: Callable[[], T], stop: Callable[[T], None],
                 wanted_by: Callable[[pytest.Item], bool] = lambda item: False,
                 idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic):
        self._start, self._stop, self.wanted_by = start, stop, wanted_by
        self.idle_s, self._clock = idle_s, clock
        self._value: T | None = None
        self._users = 0
        self._last_used = clock()
        self.starts = 0
        _SERVICES.add(self)

    @property
    def running(self) -> bool:
        return self._value is not None

    @contextmanager
    def using(self) -> Iterator[T]:
        if self._value is None:
            self._value = self._start()
            self.starts += 1
        self._users += 1
        try:
            yield self._value
        finally:
            self._users -= 1
            self._last_used = self._clock()

    def end_if_idle(self, item: pytest.Item | None = None) -> bool:
        """End the service if nobody holds it, `item` does not want it and it has waited `idle_s`."""
        if self._value is None or self._users or (item is not None and self.wanted_by(item)):
            return False
        if self._clock() - self._last_used < self.idle_s:
            return False
        self.close()
        return True

    def close(self) -> None:
        value, self._value = self._value, None
        if value is not None:
            self._stop(value)


def end_idle_services(item: pytest.Item) -> None:
    """Called before each test: ends every service that has waited long enough and `item` does not want."""
    for service in list(_SERVICES):
        service.end_if_idle(item)
