"""--stop-on-parity-drift: a run whose parity probe reads non-zero trains off-policy; end it there.

Before a rollout trains, both sides' weights are digested (dtype and checksum of every transformer
tensor: the train forward's, the first engine's, miles.models.precision.weight_digests): the weights
the engines sampled that rollout with and the ones the probe recomputes it with. When the probe then
reads non-zero, the stop names the tensors whose dtype or value differed; when none did, it says so
(the difference is then in the forward itself, not in the weights).
"""

from __future__ import annotations

from miles.models.precision import differing
from miles.ray.faults import DETERMINISTIC, RunFailure
from miles.records.run_logging import PARITY_KEYS, parity_drift

NAMED = 8  # tensors named in the stop's line; every one goes to the failure record's cause


class ParityDrift(RunFailure):
    """The parity probe read non-zero with --stop-on-parity-drift."""


def digests_before_training(enabled: bool, trainer, rollout) -> tuple[dict, dict] | None:
    if not enabled or trainer is None:
        return None
    return trainer.weight_digests(), rollout.weight_digests()


def stop_on_drift(before: tuple[dict, dict] | None, metrics: dict, rollout_id: int) -> None:
    drift = parity_drift(metrics)
    if before is None or not drift:
        return
    names = differing(*before)
    if names:
        which = (f"{len(names)} tensors differ between the train forward and the engines (dtype:crc32, train vs "
                 f"engine): " + "; ".join(names[:NAMED]) + (" ..." if len(names) > NAMED else ""))
    else:
        which = "every weight tensor was equal on both sides in dtype and value: the forward itself differs"
    values = ", ".join(f"{k}={metrics[k]:.4g}" for k in PARITY_KEYS if k in drift)
    raise ParityDrift("driver", None, "", f"parity probe non-zero ({values}), the run trains off-policy; {which}; "
                      f"fix: make both sides hold each tensor by one rule (miles.models.precision), or drop "
                      f"--stop-on-parity-drift to train on", DETERMINISTIC, what="parity probe",
                      rollout_id=rollout_id)
