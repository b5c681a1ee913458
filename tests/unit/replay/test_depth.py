"""Extrapolating a replay from two depths to the released block count (miles.replay.run, Depth)."""

from __future__ import annotations

import pytest

from miles.replay.memory import PhaseRecord, Segment
from miles.replay.run import _record_line

KEY = ("train GPU", "train rank")


def _setup(transient: int, per_block: int, blocks: int) -> PhaseRecord:
    """A setup whose text encoder's load is a transient of fixed size, and whose transformer's
    rows, read later, hold `per_block` a block on top of the encoder's 10 bytes."""
    end = 10 + per_block * blocks
    return PhaseRecord("setup", {KEY: 0}, {KEY: max(transient, end)},
                       segments=[Segment("setup", {KEY: 0}), Segment("builds text_encoder", {KEY: transient}),
                                 Segment("reads its rows of transformer", {KEY: end})])


def test_a_peak_that_moves_to_a_growing_moment_at_the_released_depth_is_extrapolated_there():
    # at 4 and 5 blocks the transient (100) is the peak, flat; at 40 the rows (10 + 7 x 40 = 290) are
    released = _setup(100, 7, 40).peak[KEY]
    line = _record_line(_setup(100, 7, 4), [(_setup(100, 7, 5), 40 - 4)])
    assert line.peak[KEY] == released == 290


def test_a_phase_whose_segments_differ_between_depths_is_refused():
    other = _setup(100, 7, 5)
    other.segments.append(Segment("builds vae", {KEY: 0}))
    with pytest.raises(RuntimeError, match="segments differ between depths"):
        _record_line(_setup(100, 7, 4), [(other, 36)])
