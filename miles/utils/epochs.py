"""Items handed out in batches over epochs, each epoch's order a function of (seed, epoch) alone.

The prompt dataset (rollouts) and the SFT dataset share it. Because an epoch's order depends on
nothing else, a resume restores the position from (epoch, offset) without replaying earlier
epochs; a batch that runs past the end of an epoch continues into the next.
"""

from __future__ import annotations

import random
from typing import Any, Generic, Sequence, TypeVar

T = TypeVar("T")


class EpochCursor(Generic[T]):
    """Subclasses set `items`, `seed`, `shuffle`, `source`, then call `_start_epoch(0)`."""

    items: list[T]
    seed: int
    shuffle: bool
    source: str
    order_salt: str = ""  # part of the shuffle seed; each dataset keeps the one its runs were made with
    noun: str = "items"  # what the items are called in errors and in the saved state
    error: type[Exception] = ValueError

    def __len__(self) -> int:
        return len(self.items)

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:  # a fresh generator per epoch: the order is a function of (seed, epoch) alone
            random.Random(f"{self.order_salt}{self.seed}:{epoch}").shuffle(order)
        return order

    def batches_per_epoch(self, batch_size: int) -> int:
        """Batches that cover one epoch (the last may spill into the next epoch)."""
        return -(-len(self.items) // batch_size)

    def next_batch(self, batch_size: int) -> list[T]:
        """The next `batch_size` items; a batch that runs past the end continues in the next epoch."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        batch: list[T] = []
        while len(batch) < batch_size:
            if self.offset == len(self._order):
                self._start_epoch(self.epoch + 1)
            take = min(batch_size - len(batch), len(self._order) - self.offset)
            batch.extend(self.items[i] for i in self._order[self.offset:self.offset + take])
            self.offset += take
        return batch

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.offset = epoch, 0  # offset: items of the current epoch already handed out
        self._order: Sequence[int] = self.epoch_order(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                f"num_{self.noun}": len(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get(f"num_{self.noun}", len(self.items))
        if saved != len(self.items):
            raise self.error(f"{self.source}: checkpoint was saved with {saved} {self.noun}, "
                             f"the file now has {len(self.items)}")
        self.seed, self.shuffle = state.get("seed", self.seed), state.get("shuffle", self.shuffle)
        self._start_epoch(int(state["epoch"]))
        self.offset = int(state["offset"])
