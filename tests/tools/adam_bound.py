"""What one AdamW step can make of a rounding-level gradient difference, for tests that compare
two runs of the same step computed two ways (1 rank vs 2 ranks, dp vs fsdp).

The two runs' gradients are the same sum computed in different orders and, under FSDP, with
different kernels and casts: they differ by rounding, but by how much depends on cancellation
inside backward (a gradient element near 0 is the difference of large terms), which no test
sees. The first AdamW step turns any gradient g into lr * g / (|g| + eps) (m and v bias-corrected):
its size is below lr whatever g is, so a weight whose gradient is within rounding of 0 can land
up to 2 lr apart on the two runs, and one with a clear gradient lands in the same place. Hence:

- per weight, |w_a - w_b| <= 2 lr plus the fp32 rounding of the step: the bound no machine can
  exceed (a bound of 1e-6 read off one machine failed on another at 1.21e-6);
- over all weights, the two steps are the same step: ||w_a - w_b|| <= ||w_1rank - w_start|| / 2.
  Only the weights whose gradient is at rounding level can differ by more than rounding, and
  they are a small part of a step of a working gradient (else the step would be noise); a run
  that stepped on another gradient (another shard, a missing reduction) moves every weight by
  about lr in an unrelated direction, ||w_a - w_b|| ~ sqrt(2) ||step||, and fails.
"""

from __future__ import annotations

import torch

U = 2.0 ** -24  # fp32 unit roundoff
STEP_OPS = 10  # fp32 operations from the gradient to the new weight in torch's AdamW (generous)


def check_first_adamw_step(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                           start: dict[str, torch.Tensor], lr: float) -> tuple[float, float]:
    """Asserts both bounds above for one AdamW step from `start`; returns (max |difference| / lr,
    ||difference|| / ||step||) for the test to print."""
    assert sorted(got) == sorted(want) == sorted(start)
    worst, diff_sq, step_sq = 0.0, 0.0, 0.0
    for name in want:
        a, b, w0 = got[name].double(), want[name].double(), start[name].double()
        # each side: the step (< lr) with STEP_OPS roundings, then one rounding of w - step
        bound = 2 * lr * (1 + STEP_OPS * U) + 2 * U * (w0.abs() + lr)
        diff = (a - b).abs()
        assert bool((diff <= bound).all()), (f"{name}: weights {float(diff.max()):.3g} apart, more than one "
                                             f"AdamW step can put them ({2 * lr:.3g})")
        worst = max(worst, float(diff.max()) / lr)
        diff_sq += float((diff ** 2).sum())
        step_sq += float(((b - w0) ** 2).sum())
    assert step_sq > 0, "the step must move the weights"
    ratio = (diff_sq / step_sq) ** 0.5
    assert ratio <= 0.5, f"the two runs took different steps: ||difference|| = {ratio:.3g} ||step||"
    return worst, ratio
