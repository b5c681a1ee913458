"""Faults: a deadline on every remote wait of the driver, one-line causes, and fault injection.

Every `ray.get` the driver does on an actor goes through `wait_for(refs, actors, what)`:
- it waits with a deadline (`Deadlines`): `--remote-timeout-s` for a kind of call not yet
  measured (actor start, the first rollout), afterwards `max(--remote-timeout-min-s,
  --remote-timeout-factor x the slowest such call so far)`;
- it returns as soon as any actor dies (it never waits for the others: a surviving train rank may
  be blocked in a collective with the dead one);
- an actor that died, or did not answer in time, becomes a `RunFailure` naming the role, rank,
  node and pid (from the `ROSTER`) and the cause as Ray reported it.

Every actor is watched from the moment it is created (`watch_creation`): each wait also listens
for the constructors of actors not yet known to be up, and for calls started in the background
(`watch_calls`: the train ranks' set-up), so a constructor that raises (a missing checkpoint) ends
the run at once, from whatever wait the driver is in, instead of leaving it waiting on something
else (a reward worker that cannot be placed because the dead engine's run never freed anything).

`RunFailure.kind` says whether an automatic restart may help (`infrastructure`: an actor or node
died, a deadline passed) or not (`deterministic`: an exception of ours, a NaN). The driver writes
the failure to `<run_dir>/failure.json`; the launcher turns it into its last line and decides on a
restart (`--max-restarts`).

`--debug-fault KIND@ROLLOUT` injects one fault for the fault suite (docs/faults.md). It fires once
per run directory: a marker under `<run_dir>/faults/` keeps a restarted attempt from firing it again.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from miles.flags.debug_faults import FAULT_KINDS, START_KINDS, _arm, fault_due, missing_checkpoint, parse_fault

INFRASTRUCTURE = "infrastructure"
DETERMINISTIC = "deterministic"
FAILURE_FILE = "failure.json"



class RunFailure(RuntimeError):
    """One part of the run failed: who, where, why, and whether a restart may help."""

    def __init__(self, role: str, rank: int | None, node: str, cause: str, kind: str, *, pid: int | None = None,
                 what: str = "", rollout_id: int | None = None):
        self.role, self.rank, self.node, self.cause_text, self.kind = role, rank, node, cause, kind
        self.pid, self.what, self.rollout_id = pid, what, rollout_id
        self.detail = ""  # the actor's own traceback, when Ray handed it over (printed to the job log)
        super().__init__(self.line())

    def who(self) -> str:
        rank = f" {self.rank}" if self.rank is not None else ""
        pid = f", pid {self.pid}" if self.pid else ""
        return f"{self.role}{rank} (node {self.node or '?'}{pid})"

    def line(self) -> str:
        during = f" during {self.what}" if self.what else ""
        at = f" at rollout {self.rollout_id}" if self.rollout_id is not None else ""
        return f"{self.who()} failed{during}{at}: {self.cause_text} [{self.kind}]"

    def record(self) -> dict:
        return {"role": self.role, "rank": self.rank, "node": self.node, "pid": self.pid, "cause": self.cause_text,
                "kind": self.kind, "what": self.what, "rollout_id": self.rollout_id, "line": self.line()}


class NonFiniteError(RunFailure):
    """A loss or gradient norm became NaN/Inf: the update is not saved and the run stops."""


class PlacementFailure(RunFailure):
    """The cluster cannot hold the layout (deterministic: it never will), or did not within
    --placement-timeout-s (infrastructure: the resources exist, other work held them)."""

    def __init__(self, cause: str, kind: str, node: str = ""):
        super().__init__("placement", None, node, cause, kind, what="placement")

    def who(self) -> str:
        return f"placement (head node {self.node or '?'})"

    def line(self) -> str:
        return f"{self.who()}: {self.cause_text} [{self.kind}]"


# -- who is who ---------------------------------------------------------------------------------

@dataclass
class Member:
    role: str
    rank: int | None
    node: str = ""
    pid: int | None = None


class Roster:
    """Actor id -> (role, rank, node, pid), filled when actors start."""

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}

    @staticmethod
    def key(actor: Any) -> str:
        return actor._actor_id.hex()

    def register(self, actors: Sequence[Any], role: str) -> None:
        """Name the actors and ask each (in parallel) for its node and pid; call once they are ready."""
        import ray

        for rank, actor in enumerate(actors):
            self.members[self.key(actor)] = Member(role, rank)
        refs = [a.__ray_call__.remote(_where) for a in actors]
        places = wait_for(refs, actors, "locate")
        for actor, (node, pid) in zip(actors, places):
            member = self.members[self.key(actor)]
            member.node, member.pid = node, pid

    def of(self, actor: Any, role: str = "actor") -> Member:
        return self.members.get(self.key(actor)) or Member(role, None)

    def record(self) -> list[dict]:
        return [asdict(m) for m in self.members.values()]


def _where(_self: Any) -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), os.getpid()


ROSTER = Roster()


class Watch:
    """Refs the driver has not waited on yet but must hear of at once: each actor's creation
    (Ray's `__ray_ready__`) and calls started in the background. `wait_for` waits on them beside
    its own refs; a success is forgotten, a failure raised as if it were one of its own."""

    def __init__(self) -> None:
        self.pending: dict[Any, tuple[Any, str]] = {}  # ref -> (actor, what)

    def add(self, refs: Sequence[Any], actors: Sequence[Any], what: str) -> None:
        for ref, actor in zip(refs, actors):
            self.pending[ref] = (actor, what)

    def refs(self, excluding: Sequence[Any] = ()) -> list:
        skip = set(excluding)
        return [ref for ref in self.pending if ref not in skip]

    def settle(self, ref: Any) -> None:
        """`ref` is ready: forget it, raising its failure if it failed."""
        import ray

        actor, what = self.pending.pop(ref)
        try:
            ray.get(ref)
        except Exception as err:
            raise _failure_of(err, actor, what) from err

    def forget(self, actors: Sequence[Any]) -> None:
        """Before ending `actors` on purpose: their deaths are no failure."""
        keys = {ROSTER.key(a) for a in actors}
        self.pending = {r: (a, w) for r, (a, w) in self.pending.items() if ROSTER.key(a) not in keys}

    def clear(self) -> None:
        self.pending.clear()


WATCH = Watch()


def watch_creation(actors: Sequence[Any], role: str) -> None:
    """Call right after creating `actors` (rank = index): from now on every wait of the driver
    ends at once if one of their constructors fails, naming the role and rank."""
    for rank, actor in enumerate(actors):
        ROSTER.members.setdefault(ROSTER.key(actor), Member(role, rank))
    WATCH.add([a.__ray_ready__.remote() for a in actors], actors, "start")


def watch_calls(refs: Sequence[Any], actors: Sequence[Any], what: str) -> None:
    """Calls the driver will wait on later (`refs[i]` answered by `actors[i]`): a failure among
    them ends whatever wait comes first."""
    WATCH.add(refs, actors, what)


# -- deadlines ----------------------------------------------------------------------------------

class Deadlines:
    """How long the driver waits for each kind of remote call."""

    def __init__(self, first_s: float = 1800.0, factor: float = 10.0, min_s: float = 120.0):
        self.first_s, self.factor, self.min_s = first_s, factor, min_s
        self.slowest: dict[str, float] = {}

    @classmethod
    def from_args(cls, args: Any) -> "Deadlines":
        return cls(args.remote_timeout_s, args.remote_timeout_factor, args.remote_timeout_min_s)

    def timeout(self, what: str) -> float:
        if what not in self.slowest:
            return self.first_s
        return max(self.min_s, self.factor * self.slowest[what])

    def explain(self, what: str) -> str:
        if what not in self.slowest:
            return f"--remote-timeout-s {self.first_s:g} (first {what})"
        return (f"max(--remote-timeout-min-s {self.min_s:g}, --remote-timeout-factor {self.factor:g} x slowest "
                f"{what} so far {self.slowest[what]:.2f}s)")

    def measured(self, what: str, seconds: float) -> None:
        self.slowest[what] = max(seconds, self.slowest.get(what, 0.0))


DEADLINES = Deadlines()
CURRENT_ROLLOUT: list[int | None] = [None]  # the rollout the driver is in, for the failure line


def configure(args: Any) -> None:
    global DEADLINES
    DEADLINES = Deadlines.from_args(args)
    WATCH.clear()  # a new run in this process: nothing of an earlier one's actors is watched


def _ray_cause(err: BaseException) -> str:
    """Ray's reason for an actor death, on one line: the part after its boilerplate."""
    text = str(getattr(err, "error_msg", "") or err)
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    keep = [l for l in lines if not l.startswith(("The actor died unexpectedly", "class_name:", "actor_id:", "pid:",
                                                  "ip:", "namespace:", "name:"))]
    cause = " ".join(keep) or (lines[0] if lines else type(err).__name__)
    for boilerplate in (" There are some potential root causes", " Some common causes include"):
        cause = cause.split(boilerplate)[0]
    cause = cause.replace("The actor is dead because its worker process has died. ", "its worker process died: ")
    if "End of file" in cause or "connection error" in cause:
        cause += " (the process vanished without exiting: a signal such as SIGKILL, the OOM killer, or a crash)"
    return f"{type(err).__name__}: {cause}"


def _field(err: BaseException, name: str) -> str:
    for line in str(getattr(err, "error_msg", "") or err).splitlines():
        line = line.strip()
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    return ""


def actor_failure(err: BaseException, member: Member, what: str) -> RunFailure:
    if creation_failed(err):
        return creation_failure(err, member)
    node = _field(err, "ip") or member.node
    pid = _field(err, "pid")
    return RunFailure(member.role, member.rank, node, _ray_cause(err), INFRASTRUCTURE,
                      pid=int(pid) if pid.isdigit() else member.pid, what=what, rollout_id=CURRENT_ROLLOUT[0])


# an exception of these kinds in a constructor says the machine or network failed, not the input
INFRASTRUCTURE_CAUSES = frozenset({
    "ConnectionError", "ConnectionResetError", "ConnectionRefusedError", "ConnectionAbortedError", "BrokenPipeError",
    "TimeoutError", "RaySystemError", "NodeDiedError", "ObjectLostError", "OwnerDiedError", "WorkerCrashedError",
})
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*)(?:: (.*))?$")
_CREATION_PLACE = re.compile(r"\(pid=(\d+), ip=([^,)]+)")


def creation_failed(err: BaseException) -> bool:
    """Ray's error for an actor whose constructor raised (on any call to it, or its readiness)."""
    text = str(getattr(err, "error_msg", "") or "")
    return bool(getattr(err, "_actor_init_failed", False)) or "error raised in its creation task" in text


def root_cause(text: str) -> tuple[str, str]:
    """(exception type, 'Type: message') of the innermost exception in a Python traceback's text:
    its last unindented 'Name: message' line (Ray's own header lines have spaces in the name)."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    for line in reversed(lines):
        if not line or line[0].isspace():
            continue
        match = _EXCEPTION_LINE.match(line)
        if match and (match.group(2) is not None or match.group(1).endswith(("Error", "Exception"))):
            return match.group(1), line if match.group(2) is not None else match.group(1)
    first = next((line.strip() for line in lines if line.strip()), "")
    return "", first or "(no message)"


def creation_kind(exc_type: str) -> str:
    """A constructor that raised: bad input or data (deterministic: a restart repeats it) unless
    the exception says the machine or network failed."""
    return INFRASTRUCTURE if exc_type in INFRASTRUCTURE_CAUSES else DETERMINISTIC


def creation_failure(err: BaseException, member: Member) -> RunFailure:
    """An actor's constructor raised: the root cause on the line, the actor's traceback kept in
    `detail` (the driver prints it to the job log, above its one line)."""
    text = _ANSI.sub("", str(getattr(err, "error_msg", "") or err))
    exc_type, cause = root_cause(text)
    place = _CREATION_PLACE.search(text)
    pid = int(place.group(1)) if place else member.pid
    node = place.group(2).strip() if place else member.node
    failure = RunFailure(member.role, member.rank, node, cause, creation_kind(exc_type), pid=pid, what="start",
                         rollout_id=CURRENT_ROLLOUT[0])
    failure.detail = text
    return failure


def _failure_of(err: Exception, actor: Any, what: str) -> Exception:
    """What `wait_for` raises for a failed ref of `actor`: a RunFailure for a dead actor, else the
    actor's own exception tagged with who raised it."""
    member = ROSTER.of(actor)
    if _is_infrastructure(err):
        return actor_failure(err, member, what)
    place = _CREATION_PLACE.search(_ANSI.sub("", str(err)))
    if place and not member.node:  # raised before the roster located it (set-up): Ray's error says where
        member = Member(member.role, member.rank, place.group(2).strip(), int(place.group(1)))
    try:  # an exception of ours inside the actor: keep its type, remember who raised it
        err.miles_member, err.miles_what = member, what
    except AttributeError:
        pass
    return err


def _is_infrastructure(err: BaseException) -> bool:
    import ray.exceptions as rex

    kinds = tuple(k for k in (getattr(rex, n, None) for n in (
        "RayActorError", "ActorDiedError", "ActorUnavailableError", "OutOfMemoryError", "NodeDiedError",
        "WorkerCrashedError", "ObjectLostError", "OwnerDiedError", "ReferenceCountingAssertionError",
        "LocalRayletDiedError", "RaySystemError")) if isinstance(k, type))
    return isinstance(err, kinds) and not isinstance(err, rex.RayTaskError)


def wait_for(refs: Sequence[Any], actors: Sequence[Any], what: str, *, deadlines: Deadlines | None = None) -> list:
    """`ray.get(refs)` with a deadline; `actors[i]` is the actor answering `refs[i]`. The first
    dead or silent actor raises RunFailure at once; an exception raised by our own code inside an
    actor is re-raised as is (Ray's error is also an instance of the original exception class).
    Meanwhile the watched refs (`watch_creation`, `watch_calls`) end the wait as soon as one fails."""
    import ray

    deadlines = deadlines or DEADLINES
    refs = list(refs)
    owner = {ref: actors[i] for i, ref in enumerate(refs)}
    timeout = deadlines.timeout(what)
    start = time.monotonic()
    pending, results = list(refs), {}
    while pending:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            member = ROSTER.of(owner[pending[0]])
            stuck = ", ".join(ROSTER.of(owner[r]).role + (f" {ROSTER.of(owner[r]).rank}" if ROSTER.of(owner[r]).rank
                                                           is not None else "") for r in pending)
            raise RunFailure(member.role, member.rank, member.node,
                             f"no answer to {what} within {timeout:.1f}s (deadline {deadlines.explain(what)}; "
                             f"still waiting on: {stuck})", INFRASTRUCTURE, pid=member.pid, what=what,
                             rollout_id=CURRENT_ROLLOUT[0])
        watched = WATCH.refs(excluding=refs)
        ready, _ = ray.wait(pending + watched, num_returns=1, timeout=left)
        for ref in ready:
            if ref in owner:
                pending.remove(ref)
                WATCH.pending.pop(ref, None)  # a watched call this wait answers itself
                try:
                    results[ref] = ray.get(ref)
                except Exception as err:
                    raise _failure_of(err, owner[ref], what) from err
            else:
                WATCH.settle(ref)
    deadlines.measured(what, time.monotonic() - start)
    return [results[r] for r in refs]


def wait_ready(ref: Any, timeout: float) -> bool:
    """Whether `ref` (not an actor's: a placement group's readiness) is ready within `timeout`
    seconds; a watched failure meanwhile raises at once."""
    import ray

    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        ready, _ = ray.wait([ref, *WATCH.refs(excluding=[ref])], num_returns=1, timeout=max(0.0, left))
        if ref in ready:
            return True
        for other in ready:
            WATCH.settle(other)
        if not ready or left <= 0:
            return False


def watchful_sleep(seconds: float) -> None:
    """Sleep `seconds`, but a watched failure meanwhile raises at once."""
    import ray

    watched = WATCH.refs()
    if not watched:
        time.sleep(max(0.0, seconds))
        return
    ready, _ = ray.wait(watched, num_returns=1, timeout=max(0.0, seconds))
    for ref in ready:
        WATCH.settle(ref)


# -- non-finite numbers -------------------------------------------------------------------------

def check_finite(metrics: dict, rollout_id: int, keys: Sequence[str] = ("train/loss", "train/grad_norm")) -> None:
    bad = {k: metrics[k] for k in keys if isinstance(metrics.get(k), float) and not math.isfinite(metrics[k])}
    if bad:
        member = next((m for m in ROSTER.members.values() if m.role == "train rank"), Member("train rank", 0))
        raise NonFiniteError(member.role, member.rank, member.node,
                             "non-finite " + ", ".join(f"{k}={v}" for k, v in bad.items())
                             + "; the update is not saved", DETERMINISTIC, pid=member.pid, what="train",
                             rollout_id=rollout_id)


# -- the failure record -------------------------------------------------------------------------

def classify(err: BaseException) -> RunFailure:
    """Any exception that ended the driver, as a RunFailure (ours already are)."""
    if isinstance(err, RunFailure):
        return err
    cause = err
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause
    lines = [l.strip() for l in str(cause).splitlines() if l.strip()]
    text = f"{type(cause).__name__}: {lines[0] if lines else '(no message)'}"
    import socket

    try:
        node = __import__("ray").util.get_node_ip_address()
    except Exception:
        node = socket.gethostname()
    kind = INFRASTRUCTURE if _is_infrastructure_safe(err) else DETERMINISTIC
    member = getattr(err, "miles_member", None)
    if member is not None:  # raised inside an actor: name the actor
        return RunFailure(member.role, member.rank, member.node, text, kind, pid=member.pid,
                          what=getattr(err, "miles_what", ""), rollout_id=CURRENT_ROLLOUT[0])
    return RunFailure("driver", None, node, text, kind, pid=os.getpid(), rollout_id=CURRENT_ROLLOUT[0])


def _is_infrastructure_safe(err: BaseException) -> bool:
    try:
        return _is_infrastructure(err)
    except ImportError:
        return False


def write_failure(run_dir: str | Path, failure: RunFailure, checkpoint: tuple[int, Path] | None) -> Path:
    record = failure.record()
    record["checkpoint"] = str(checkpoint[1]) if checkpoint else None
    record["checkpoint_rollout_id"] = checkpoint[0] if checkpoint else None
    record["time"] = time.time()
    path = Path(run_dir) / FAILURE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FAILURE_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_failure(run_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / FAILURE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def disk_reason(directory: str | Path, size: int = 1 << 20) -> OSError | None:
    """The OS's reason why writing under `directory` fails (ENOSPC, EFBIG, EROFS, ...), or None."""
    probe = Path(directory) / ".write_probe"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"\0" * size)
            fh.flush()
            os.fsync(fh.fileno())
        return None
    except OSError as err:
        return err
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


# -- fault injection (--debug-fault; the kinds and the failures: miles.flags.debug_faults) -----

_TARGET = {"train-kill": "trainer", "nan": "trainer", "disk-full": "trainer", "slow-save": "trainer",
           "engine-kill": "engines", "reward-kill": "rewards", "reward-hang": "rewards"}


def arm_for_rollout(args: Any, rollout_id: int, trainer: Any, rollout: Any) -> None:
    """The driver, at the top of each rollout: arm the --debug-fault actor when its rollout comes."""
    kind, _ = parse_fault(args.debug_fault)
    if kind in START_KINDS or not fault_due(args, kind, rollout_id):
        return
    target = _TARGET[kind]
    if target == "trainer":
        actors = trainer.actors if trainer is not None else []
    elif target == "engines":
        actors = getattr(rollout, "engines", [])
    else:
        actors = getattr(getattr(rollout, "rewards", None), "workers", [])
    if not actors:
        raise ValueError(f"--debug-fault {args.debug_fault}: this run has no {target} to inject into")
    print(f"fault injection: {kind} at rollout {rollout_id} ({FAULT_KINDS[kind]})", flush=True)
    arm(actors[-1], kind)


def args_per_engine(args: Any, n: int) -> list:
    """Each engine's flags: `args`, except with `--debug-fault engine-init@0` the last engine's
    checkpoint directory does not exist (its constructor raises CheckpointError)."""
    broken = missing_checkpoint(args, "engine-init") if n and getattr(args, "debug_fault", None) else None
    if broken is None:
        return [args] * n
    from argparse import Namespace

    return [args] * (n - 1) + [Namespace(**{**vars(args), "hf_checkpoint": broken})]


def args_for_setup(args: Any, rank: int, world_size: int) -> Any:
    """A train rank's flags for its set-up: `args`, except with `--debug-fault train-setup@0` the
    last rank's checkpoint directory does not exist (its set-up raises CheckpointError)."""
    if rank != world_size - 1 or not getattr(args, "debug_fault", None):
        return args
    broken = missing_checkpoint(args, "train-setup")
    if broken is None:
        return args
    from argparse import Namespace

    return Namespace(**{**vars(args), "hf_checkpoint": broken})


def arm(actor: Any, kind: str) -> None:
    """Make `actor` carry out `kind` in its next call (sequential actors: this runs first)."""
    wait_for([actor.__ray_call__.remote(_arm, kind)], [actor], "arm fault")
