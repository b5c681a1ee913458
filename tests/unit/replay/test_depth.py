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


def _train(blocks: int) -> PhaseRecord:
    """A train step whose backward holds activations (100 + 7 a block) and whose optimizer step
    holds AdamW's state and the gradients (20 a block): the backward holds the most at 4 and 5
    blocks, the step from 8 on. The optimizer step is a segment of its own (miles.replay.seams)."""
    backward, step = 100 + 7 * blocks, 20 * blocks
    return PhaseRecord("train", {KEY: 0}, {KEY: max(backward, step)},
                       segments=[Segment("train", {KEY: backward}), Segment("train rank optimizer step", {KEY: step})])


def test_a_train_step_whose_optimizer_step_outgrows_its_backward_is_extrapolated_to_the_step():
    line = _record_line(_train(4), [(_train(5), 48 - 4)])
    assert line.peak[KEY] == _train(48).peak[KEY] == 960
    # one segment over both moments: the backward's line, as LTX-2.3 full extrapolated before (45.6 GiB for 74.7)
    merged = [PhaseRecord("train", {KEY: 0}, r.peak, segments=[Segment("train", r.peak)]) for r in (_train(4), _train(5))]
    assert _record_line(merged[0], [(merged[1], 44)]).peak[KEY] == 100 + 7 * 48
