"""The bad-input sweep's fast rows, run from the outside as the sweep runs them: each exits
non-zero with one line naming its input, no traceback, nothing written into the repository, and
within its deadline. One or two rows per entry point that stop at parse time (well under a second
each); `python3 ci/bad_input_sweep.py` runs the whole table."""

from __future__ import annotations

import pytest

from ci.bad_input_sweep import judge, run_row
from ci.bad_inputs import ALL, BadInput

FAST = ["recipe --seed -5", "recipe --train-ranks 0", "train --seed -5", "sample --num-samples -1",
        "sample --height 63", "run_suite --gpus 0", "run_suite malformed --ray-address",
        "export missing source", "replay --depth bad",
        # issue 45's last points: train_diffusion.py's own file checks before Ray, the line number of a
        # byte that is not UTF-8, train ranks named as such, LoRA targets matched against the weights
        "train --prompt-data missing", "train --prompt-data non-UTF-8", "recipe non-UTF-8 prompt file",
        "train --lora-target-modules nothing", "recipe --train-ranks 4", "train --custom-loss-function-path missing"]
ROWS = {r.name: r for r in ALL}


@pytest.mark.parametrize("name", FAST)
def test_a_bad_input_ends_in_one_line_naming_it(name, tmp_path, tiny_checkpoint):
    outcome = run_row(ROWS[name], tiny_checkpoint("sd3"), None, tmp_path)
    assert not outcome.problems, (outcome.problems, outcome.last_line)


def test_the_judge_fails_an_accepted_input_a_traceback_and_a_line_that_names_something_else():
    row = BadInput("x", ("true",), "--seed")
    assert judge(row, 0, 0.1, "", "error: --seed -5: must be >= 0", "").problems == ["exit 0 (accepted)"]
    traced = judge(row, 1, 0.1, "", "Traceback (most recent call last):\nValueError: --seed", "")
    assert traced.problems == ["traceback"]
    assert judge(row, 2, 0.1, "", "error: --lr 0", "").problems == ["last line does not name '--seed'"]
    assert judge(row, None, 60.0, "", "error: --seed", "").problems == ["hung past 120 s"]
