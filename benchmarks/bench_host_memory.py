"""Bytes through the driver and peak host memory per process, at proxy size and at full scale.

Measured at proxy size (before and after, in one run) and extrapolated to every full-scale recipe.

    nice -n 19 python3 benchmarks/bench_host_memory.py [--before REF] [--rollouts 2] [--no-replay]

The run is the Wan2.2 17-GPU recipe's CPU proxy (tiny wan2_2, 64 px x 5 frames, 6 steps, 2
prompts x 4 samples a rollout, 2 colocated CPU train ranks and engines, the tiny PickScore in a CPU
reward worker, debug mode), plus an eval of 4 prompts after every rollout, driven in process by
`train_diffusion.main` on a private Ray cluster. It is run twice, each in a fresh process: on this
tree, and (--before, default `main`) on that commit checked out in a temporary git worktree.

Bytes through the driver: everything the driver process receives from a remote call (`ray.get`)
and hands to one (`ActorMethod._remote` arguments, `ray.put`), pickled; an ObjectRef counts as
REF_BYTES, whatever it points at (the bytes stay where they are). Counted while the rollout
manager generates and the train group trains (per rollout), and while it evaluates (per eval);
weight pushes are left out (weights, not samples). The thumbnails the driver keeps for
last_rollout.png are reported apart. Peak RSS: VmHWM of the driver (reset before the run) and of
every Ray worker process under it, named by its actor class, read every 0.1 s until it ends.

Extrapolation (every full-scale recipe, from its dry run's flags): bytes per rollout = the measured
per-sample bytes x the recipe's samples; the before figures scale each sample by the ratio of its
whole path and decoded video at the recipe's size to the proxy's (miles.plan.host_plan.sample_bytes;
the conditioning, a small share at either size, left out of the ratio);
host memory per node and per process from the replay (`python3 -m miles.replay`, extrapolated depth).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REF_BYTES = 64  # an ObjectRef on the wire: its 28-byte id and its owner's address
MIB = 2 ** 20
GIB = 2 ** 30
ASSETS = Path("/tmp/miles-bench-host-memory")
ROLES = ("TrainActor", "RolloutEngineActor", "RewardWorker")  # Ray worker processes by actor class


# -- one measured run (in a fresh process, with the tree under test first on sys.path) ----------------

def _wire_size(value) -> int:
    import io

    import ray

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return "ref" if isinstance(obj, ray.ObjectRef) else None

    refs = _count_refs(value)
    buffer = io.BytesIO()
    Pickler(buffer, protocol=5).dump(value)
    return len(buffer.getvalue()) + refs * REF_BYTES


def _count_refs(value, depth: int = 0) -> int:
    import dataclasses

    import ray

    if isinstance(value, ray.ObjectRef):
        return 1
    if depth > 4:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_count_refs(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(_count_refs(v, depth + 1) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_count_refs(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    return 0


def _thumbnail_bytes(value) -> int:
    import numpy as np

    if isinstance(value, list):
        return sum(_thumbnail_bytes(v) for v in value)
    thumb = getattr(value, "thumbnail", None)
    return thumb.nbytes if isinstance(thumb, np.ndarray) else 0


class DriverTally:
    """What crosses the driver process, by the phase the loop is in."""

    def __init__(self):
        self.phase, self.bytes, self.thumbnails, self.calls = None, {}, 0, 0

    def add(self, nbytes: int) -> None:
        if self.phase is not None:
            self.bytes.setdefault(self.phase, []).append(nbytes)

    def install(self) -> None:
        import ray
        from ray.actor import ActorMethod

        get, put, remote = ray.get, ray.put, ActorMethod._remote
        tally = self

        def counted_get(refs, *args, **kwargs):
            out = get(refs, *args, **kwargs)
            tally.add(_wire_size(out))
            if tally.phase and tally.phase[0] == "rollout":
                tally.thumbnails += _thumbnail_bytes(out)
            return out

        def counted_put(value, *args, **kwargs):
            tally.add(_wire_size(value))
            return put(value, *args, **kwargs)

        def counted_remote(self, args=None, kwargs=None, *rest, **options):
            tally.add(_wire_size((args, kwargs)))
            return remote(self, args, kwargs, *rest, **options)

        ray.get, ray.put, ActorMethod._remote = counted_get, counted_put, counted_remote

    def during(self, cls, method: str, phase: str) -> None:
        original = getattr(cls, method)
        tally = self

        def wrapped(obj, *args, **kwargs):
            tally.calls += 1
            saved, tally.phase = tally.phase, (phase, tally.calls)
            tally.bytes[tally.phase] = []
            try:
                return original(obj, *args, **kwargs)
            finally:
                tally.phase = saved
        setattr(cls, method, wrapped)


class PeakRss:
    """VmHWM of every process under this one, by its Ray actor class, sampled until stopped."""

    def __init__(self):
        self.peaks: dict[int, tuple[str, int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        me = psutil.Process()
        while not self.stop.wait(0.1):
            for child in me.children(recursive=True):
                try:
                    name = child.cmdline()[0] if child.cmdline() else ""
                    hwm = _vm_hwm(child.pid)
                except (psutil.Error, OSError, IndexError):
                    continue
                role = name[5:].split(".")[0].split(" ")[0]
                if name.startswith("ray::") and hwm and role in ROLES:
                    self.peaks[child.pid] = (role, max(hwm, self.peaks.get(child.pid, ("", 0))[1]))

    def by_role(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for role, peak in self.peaks.values():
            out.setdefault(role, []).append(peak)
        return {role: sorted(v) for role, v in out.items()}


def _vm_hwm(pid: str | int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def proxy_argv(run_dir: Path, rollouts: int) -> list[str]:
    from miles.proxy_assets.checkpoint import ensure_checkpoint
    from miles.proxy_assets.pickscore import ensure_tiny_pickscore
    from miles.proxy_assets.prompts import ensure_prompt_file

    checkpoint = ensure_checkpoint("wan2_2", "tiny", 0, ASSETS)
    pickscore = ensure_tiny_pickscore(ASSETS)
    prompts = ensure_prompt_file("general", ASSETS / "prompts.jsonl", num_prompts=16)
    held_out = ensure_prompt_file("general", ASSETS / "eval_prompts.jsonl", num_prompts=8, seed=1)
    return (f"--run-dir {run_dir} --hf-checkpoint {checkpoint} --diffusion-model-family wan2_2 --prompt-data {prompts} "
            f"--num-rollout {rollouts} --rollout-batch-size 2 --n-samples-per-prompt 4 --diffusion-height 64 "
            "--diffusion-width 64 --diffusion-output-num-frames 5 --diffusion-num-steps 6 --diffusion-num-sde-steps 2 "
            "--diffusion-sde-window-max-start 4 --diffusion-guidance-scale-2 3.0 --num-steps-per-rollout 2 --lr 5e-6 "
            f"--rm-type pickscore --pickscore-model-path {pickscore} --rm-num-workers 1 --rm-num-gpus-per-worker 0 "
            "--update-weight-target-module transformer transformer_2 --micro-batch-size 1 --rollout-microgroup-size 1 "
            "--device cpu --actor-num-gpus-per-node 2 --num-gpus-per-node 2 --colocate --diffusion-debug-mode "
            f"--deterministic-mode --eval-interval 1 --eval-prompt-data {held_out} --eval-num-prompts 4 "
            "--skip-eval-before-train").split()


def measure(rollouts: int) -> dict:
    """One run of the tree first on sys.path: what crossed the driver and each process's peak RSS."""
    import ray

    import train_diffusion
    from miles.ray.rollout_manager import RolloutManager
    from miles.ray.train_actor_group import TrainActorGroup

    tally = DriverTally()
    tally.install()
    tally.during(RolloutManager, "generate", "rollout")
    tally.during(TrainActorGroup, "train", "rollout")
    tally.during(RolloutManager, "evaluate", "eval")
    temp = _start_ray()
    rss = PeakRss()
    rss.thread.start()
    Path("/proc/self/clear_refs").write_text("5")  # the driver's VmHWM from here
    with tempfile.TemporaryDirectory() as run_dir:
        argv = proxy_argv(Path(run_dir), rollouts)
        code = train_diffusion.main(argv)
    rss.stop.set()
    rss.thread.join()
    driver_peak = _vm_hwm("self")
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
    per_rollout, per_eval = _phase_sums(tally.bytes)
    return {"code": code, "rollout_bytes": per_rollout, "eval_bytes": per_eval, "thumbnail_bytes": tally.thumbnails,
            "samples": 8, "eval_samples": 4, "rss": {"driver": [driver_peak], **rss.by_role()}}


def _start_ray(attempts: int = 3) -> str:
    """A private cluster (a temp dir of its own, returned); a loaded machine can miss Ray's start-up deadline."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    for attempt in range(attempts):
        temp = tempfile.mkdtemp(prefix="bhm", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp,
                     runtime_env={"env_vars": {"PYTHONPATH": sys.path[0], "OMP_NUM_THREADS": "1"}})
            return temp
        except Exception:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _phase_sums(tallied: dict) -> tuple[list[int], list[int]]:
    rollouts = [sum(v) for (phase, _), v in sorted(tallied.items(), key=lambda kv: kv[0][1]) if phase == "rollout"]
    evals = [sum(v) for (phase, _), v in sorted(tallied.items(), key=lambda kv: kv[0][1]) if phase == "eval"]
    return _merge_train(rollouts, len(evals)), evals


def _merge_train(parts: list[int], rollouts: int) -> list[int]:
    """generate and train are tallied apart: two parts a rollout."""
    if rollouts and len(parts) == 2 * rollouts:
        return [parts[2 * i] + parts[2 * i + 1] for i in range(rollouts)]
    return parts


# -- the comparison --------------------------------------------------------------------------------

def run_tree(root: Path, rollouts: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, __file__, "--measure", str(root), "--rollouts", str(rollouts)],
                         cwd=root, env=env, capture_output=True, text=True, check=False)
    line = next((l for l in reversed(out.stdout.splitlines()) if l.startswith("{")), None)
    if out.returncode or line is None:
        raise SystemExit(f"measuring {root} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line)


def before_tree(ref: str) -> tuple[Path, callable]:
    where = Path(tempfile.mkdtemp(prefix="bhm-before-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where / "tree"), ref], check=True,
                   capture_output=True)

    def remove() -> None:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where / "tree")], check=False,
                       capture_output=True)
        shutil.rmtree(where, ignore_errors=True)

    return where / "tree", remove


def report(before: dict, after: dict) -> dict[str, float]:
    """The proxy table, and the per-sample figures the extrapolation scales."""
    mean = lambda v: sum(v) / max(1, len(v))  # noqa: E731
    print("\nproxy (Wan2.2 17-GPU recipe's CPU proxy: 8 samples a rollout, 4 eval prompts)")
    print(f"{'':32s}{'before':>14s}{'after':>14s}")
    rows = [("bytes through the driver / rollout", mean(before["rollout_bytes"]), mean(after["rollout_bytes"])),
            ("  of which thumbnails", 0.0, after["thumbnail_bytes"] / max(1, len(after["rollout_bytes"]))),
            ("bytes through the driver / eval", mean(before["eval_bytes"]), mean(after["eval_bytes"]))]
    for name, b, a in rows:
        print(f"{name:32s}{b / 1024:12.1f} K{a / 1024:12.1f} K")
    for role in sorted(set(before["rss"]) | set(after["rss"])):
        b, a = before["rss"].get(role, []), after["rss"].get(role, [])
        print(f"peak RSS {role:23s}{_mib(b):>14s}{_mib(a):>14s}")
    thumbs = after["thumbnail_bytes"] / max(1, len(after["rollout_bytes"]))
    return {"before_sample": mean(before["rollout_bytes"]) / before["samples"],
            "after_sample": (mean(after["rollout_bytes"]) - thumbs) / after["samples"],
            "before_eval_sample": mean(before["eval_bytes"]) / before["eval_samples"],
            "after_eval_sample": mean(after["eval_bytes"]) / after["eval_samples"]}


def _mib(values: list[int]) -> str:
    return ", ".join(f"{v / MIB:.0f}" for v in values) + " MiB" if values else "-"


def extrapolate(per_sample: dict[str, float], replay: bool) -> None:
    from miles.replay.doc_table import cases
    from miles.replay.recipe import recipe_flags
    from miles.plan.host_plan import THUMBNAIL_BYTES, sample_bytes
    from miles.flags.arguments import parse_and_plan
    from miles.plan.model_facts import GEOMETRY

    import diffusers

    diffusers.utils.logging.set_verbosity_error()  # the replay builds every component: a note on each, many times
    proxy_ns, proxy_plan = parse_and_plan(proxy_argv(Path("/tmp/unused"), 2))
    proxy = sample_bytes(proxy_ns, proxy_plan, None, GEOMETRY["wan2_2"])
    print("\nfull scale (per rollout / per eval; host per node from the replay)")
    for script, scale in cases(REPO):
        if scale != "full":
            continue
        ns, plan = recipe_flags(REPO / script, scale)
        if ns.loss_type == "sft_loss":
            continue
        full = sample_bytes(ns, plan, None, GEOMETRY[ns.diffusion_model_family])
        grow = full.full_trajectory / proxy.full_trajectory
        samples, evals = plan.samples_per_rollout, ns.eval_num_prompts or 0
        before = samples * per_sample["before_sample"] * grow
        after = samples * per_sample["after_sample"] + THUMBNAIL_BYTES
        eval_before = evals * per_sample["before_eval_sample"] * grow
        eval_after = evals * per_sample["after_eval_sample"]
        print(f"{Path(script).stem}: {samples} samples, {evals} eval prompts")
        print(f"  driver / rollout: before {before / GIB:8.2f} GiB   after {after / MIB:6.2f} MiB "
              f"({THUMBNAIL_BYTES / MIB:.2f} MiB of it thumbnails at most)")
        print(f"  driver / eval:    before {eval_before / GIB:8.2f} GiB   after {eval_after / MIB:6.2f} MiB")
        if replay:
            _replayed_host(script)


def _replayed_host(script: str) -> None:
    from miles.replay.report import replay_recipe

    result = replay_recipe(REPO / script, "full", extrapolate=True)
    for row in (r for r in result.rows if r.phase == "host"):
        print(f"  host {row.place}: {row.measured / GIB:.1f} GiB of {row.budget / GIB:.1f} "
              f"({'fits' if row.fits else 'DOES NOT FIT'})")
    for note in (n for n in result.notes if n.startswith("pinned")):
        print(f"  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="main", help="the commit to measure as 'before' (a git ref)")
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--no-replay", action="store_true", help="skip the replay's host figures (70 s)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: measure the tree at this path
    ns = parser.parse_args()
    if ns.measure:
        sys.path.insert(0, ns.measure)
        print(json.dumps(measure(ns.rollouts)))
        return
    started = time.time()
    after = run_tree(REPO, ns.rollouts)
    tree, remove = before_tree(ns.before)
    try:
        before = run_tree(tree, ns.rollouts)
    finally:
        remove()
    per_sample = report(before, after)
    extrapolate(per_sample, replay=not ns.no_replay)
    print(f"\n({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
