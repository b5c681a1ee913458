"""pytest hooks and fixtures of the recipe harness. Loaded as the `miles.testing` plugin."""

from __future__ import annotations

import json
import os
import warnings
from contextlib import ExitStack
from pathlib import Path

import pytest

from miles.testing.cases import RecipeCase, case_of, cases_metadata, command_line_id, find_repo_root
from miles.testing.cluster import LocalRayCluster
from miles.testing.dry import DryCheckFailure, run_dry, start_dry
from miles.testing.idle import IdleEnded, end_idle_services
from miles.testing.invariants import check_run as run_invariants
from miles.testing.leases import DEFAULT_LOCK_DIR, DEFAULT_MAX_USED_MIB, NoNvml, NotEnoughGpus, lease_gpus
from miles.testing.runner import RecipeRun, new_token, run_recipe as _run_recipe, write_result_record
from miles.testing.snapshot import PlanSnapshotAssertion, plan_snapshot_from
from miles.testing.standards import (
    Verdict,
    build_standard,
    constant_series,
    judge,
    load_standard,
    record_command,
    signal_problems,
    standard_path,
    write_standard,
)

RESULTS_DIR_ENV = "MILES_RESULTS_DIR"
MODEL_DIR_ENV = "MILES_TEST_MODEL_DIR"
_RUNS_KEY = pytest.StashKey[list]()
_SKIP_KEY = pytest.StashKey[str]()
_ENV_NOTES_KEY = pytest.StashKey[list]()

MARKERS = {
    "gpu(n)": "needs n GPUs leased through NVML; skipped with 'needs n GPUs, found m free' otherwise",
    "e2e": "runs a recipe end to end (a dry check or a real run)",
    "dry": "dry check of a recipe: argv snapshot and static validation, no cluster, seconds",
    "nightly": "GPU tier, run by the nightly GPU suite",
    "rehearsal": "a GPU case's configuration on CPU slots (bfloat16 over float32 masters, its train backend, "
                 "offload, push path, gradient checkpointing): the nightly CPU suite runs every one; a plain "
                 "`pytest` only those in the `cpu` suite; `-m rehearsal`, `-k rehearsal` or --miles-rehearsal all",
    "faults": "fault-injection suite (docs/faults.md): deselected unless `-m faults` (or an -m naming it) "
              "or --miles-faults is given",
    "slow": "an integration test of tens of seconds on 2 CPUs that goes deeper into what a faster test of the "
            "README's command already proves (docs/testing.md, \"Slow tests\"): deselected unless `-m slow` (or an "
            "-m naming it) or --miles-slow is given; the nightly CPU suite runs them",
}
# markers whose tests a plain `pytest` leaves out (reported as deselected), each with its option
_OPT_IN_MARKERS = {"faults": "--miles-faults", "slow": "--miles-slow"}


# -- options and markers ----------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("miles", "miles-diffusion recipe harness")
    group.addoption("--miles-cases-json", metavar="FILE", default=None,
                    help="write the collected recipe cases (name, recipe, tier, gpus, timeout, "
                         "est_time, suites, labels) to FILE as JSON")
    group.addoption("--miles-record-standards", action="store_true", default=False,
                    help="write the metric standards of the real runs selected, instead of "
                         "comparing against them (never done by a normal run)")
    group.addoption("--miles-standards-dir", metavar="DIR", default=None,
                    help="where metric standards live (default: standards/ beside the test module)")
    group.addoption("--miles-gpu-lock-dir", metavar="DIR", default=str(DEFAULT_LOCK_DIR),
                    help="shared directory of per-GPU lock files (default %(default)s)")
    group.addoption("--miles-gpu-wait", metavar="SECONDS", type=float, default=0.0,
                    help="wait this long for GPUs that other tests hold before skipping (default 0)")
    group.addoption("--miles-faults", action="store_true", default=False,
                    help="also run the fault-injection suite (tests marked `faults`; several minutes on 2 CPUs); "
                         "`-m faults` runs it alone")
    group.addoption("--miles-slow", action="store_true", default=False,
                    help="also run the slow integration tests (tests marked `slow`; about 10 minutes on 2 CPUs); "
                         "`-m slow` runs them alone")
    group.addoption("--miles-rehearsal", action="store_true", default=False,
                    help="run every recipe's rehearsal case (tests marked `rehearsal`), not only those of the "
                         "default run")
    group.addoption("--miles-gpu-max-used-mib", metavar="MIB", type=float, default=DEFAULT_MAX_USED_MIB,
                    help="a GPU with more memory in use than this is not free (default %(default)s)")
    group.addoption("--miles-gpu-shared", action="store_true", default=False,
                    help="the GPUs are a share the CI runner gave this test (ci/run_suite.py --gpu-shares): "
                         "lease them without waiting for them to be idle and without locking them")


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    if config.getoption("collectonly", False) and hasattr(config.option, "disable_unused_snapshots"):
        # Collecting runs no test, so syrupy would call every snapshot unused (and exit 1).
        config.option.disable_unused_snapshots = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, option in _OPT_IN_MARKERS.items():
        _deselect_marked_unless_asked(config, items, marker, option)
    _deselect_nightly_rehearsals_unless_asked(config, items)
    _shared_cluster_runs_first(items)
    wait = config.getoption("--miles-gpu-wait") or 0.0
    if not wait:
        return
    for item in items:
        case = case_of(item)
        if case is not None and case.gpus:
            item.add_marker(pytest.mark.timeout(case.pytest_timeout() + wait))


def _shared_cluster_runs_first(items: list[pytest.Item]) -> None:
    """Among the CPU runs (one xdist group, run in this order by one worker), those on the worker's
    shared cluster come first and back to back: interleaved with the own-head and multi-node runs,
    the shared head idled through them and was ended and started again (miles.testing.idle)."""
    slots = [n for n, item in enumerate(items) if (case := case_of(item)) is not None and case.tier == "cpu"]
    runs = sorted((items[n] for n in slots), key=lambda item: not case_of(item).uses_shared_cluster)
    for n, item in zip(slots, runs):
        items[n] = item


def _deselect_marked_unless_asked(config: pytest.Config, items: list[pytest.Item], marker: str, option: str) -> None:
    """The fault suite and the slow tests take minutes: a plain `pytest` leaves them out (reported as
    deselected); `-m` naming the marker, or its option, keeps them. Other markers' selection is untouched."""
    if config.getoption(option, False) or marker in (config.getoption("markexpr", "") or ""):
        return
    named = _files_named(config)  # `pytest tests/unit/ray/test_resume.py` asks for its slow test
    keep, drop = [], []
    for item in items:
        unasked = item.get_closest_marker(marker) is not None and not (named and item.path.resolve() in named)
        (drop if unasked else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _files_named(config: pytest.Config) -> set[Path]:
    """The test files the command line names, alone or in a node id (not a folder's files)."""
    paths = (Path(config.invocation_params.dir, str(arg).split("::")[0]) for arg in config.args)
    return {path.resolve() for path in paths if path.is_file()}


def _deselect_nightly_rehearsals_unless_asked(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each rehearsal case takes minutes on 2 CPUs: a plain `pytest` runs those of the `cpu` suite
    (the README's command), the nightly CPU suite all of them; `-m`/`-k` or a node id naming
    `rehearsal`, or --miles-rehearsal, keeps every one."""
    # a node id naming a rehearsal (how ci/run_suite.py runs each case) asks for it too
    asked = " ".join([config.getoption("markexpr", "") or "", config.getoption("keyword", "") or "",
                      *(str(a) for a in config.args if "::" in str(a))])
    if config.getoption("--miles-rehearsal", False) or "rehearsal" in asked:
        return
    keep, drop = [], []
    for item in items:
        case = case_of(item)
        nightly_only = case is not None and case.is_rehearsal and "cpu" not in case.suites
        (drop if nightly_only else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))


def pytest_collection_finish(session: pytest.Session) -> None:
    path = session.config.getoption("--miles-cases-json")
    if not path or _is_xdist_controller(session.config):
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid")
    if worker not in (None, "gw0"):
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cases_metadata(session.items), indent=2) + "\n")
    os.replace(tmp, out)


def pytest_runtest_setup(item: pytest.Item) -> None:
    end_idle_services(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    runs: list[RecipeRun] = item.stash.get(_RUNS_KEY, [])
    case = case_of(item)
    if runs and report.when == "call":
        for run in runs:
            phases = run.phases()
            report.sections.append((f"miles run {run.case.name}",
                                    f"output dir: {run.out_dir}\n{run.status()}; "
                                    f"wall time {run.wall_time:.1f}s\nlog: {run.log_path}\n"
                                    + "\n".join(f"{label:55s} {sec:7.1f}s" for label, sec in phases)))
            # user_properties travel from xdist workers to the controller, which prints them all
            report.user_properties.append(("miles_phases", {"case": run.case.name, "wall": run.wall_time,
                                                            "phases": phases}))
    results_dir = os.environ.get(RESULTS_DIR_ENV)
    if not results_dir or case is None or case.tier == "dry":
        return
    if report.when == "call" and runs:
        for run in runs:
            write_result_record(results_dir, run.result_record(report.outcome, command_line_id(item.nodeid)))
    elif (report.when == "setup" and report.outcome != "passed") or (report.when == "call" and not runs):
        reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
        record = {"nodeid": command_line_id(item.nodeid), "name": case.name, "outcome": report.outcome,
                  "wall_time": round(report.duration, 3), "run_json": None, "throughput": None,
                  "peak_memory": None}
        if report.outcome != "passed":
            record["reason"] = reason or str(report.longrepr)[-2000:]
        write_result_record(results_dir, record)


# -- fixtures ---------------------------------------------------------------------------

@pytest.fixture
def recipe_case(request: pytest.FixtureRequest) -> RecipeCase:
    """The case of a test parametrized with `parametrize_cases`."""
    raise pytest.UsageError(
        f"{request.node.nodeid} asks for `recipe_case` but is not parametrized with it; "
        "decorate it with @miles.testing.parametrize_cases(CASES)")


@pytest.fixture(scope="session")
def miles_repo_root(pytestconfig: pytest.Config) -> Path:
    """The repository whose `scripts/` the cases refer to."""
    try:
        return find_repo_root(pytestconfig.rootpath)
    except FileNotFoundError:
        return Path(pytestconfig.rootpath)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    """One checkpoint cache for every run of the session, shared by all xdist workers (the
    recipes' `ensure_checkpoint` makes each checkpoint once, under a file lock). Set
    MILES_TEST_MODEL_DIR to keep one across sessions."""
    if os.environ.get(MODEL_DIR_ENV):
        path = Path(os.environ[MODEL_DIR_ENV])
    else:
        base = tmp_path_factory.getbasetemp()
        if hasattr(pytestconfig, "workerinput"):
            base = base.parent  # shared by gw0, gw1, ... of this session
        path = base / "miles-models"
    path.mkdir(parents=True, exist_ok=True)
    return path


class _DryPrefetch:
    """Starts the dry runs of every selected dry case at once, when the first is needed, so the
    catalog's recipe subprocesses overlap (each test still checks only its own). Off under
    pytest-xdist, whose workers already run cases side by side."""

    def __init__(self, session: pytest.Session, base: Path, rootdir: Path):
        self.pending = {}
        for i, item in enumerate(session.items):
            case = case_of(item)
            if case is not None and case.tier == "dry" and "dry_run" in getattr(item, "fixturenames", ()):
                if case.name not in self.pending:
                    try:
                        self.pending[case.name] = (case, start_dry(case, base / f"dry-{i}", rootdir=rootdir))
                    except DryCheckFailure:
                        pass  # reported when its test asks for it

    def take(self, case: RecipeCase):
        entry = self.pending.pop(case.name, None)
        if entry is None or entry[0] != case:
            return None
        return entry[1]

    def close(self) -> None:
        for _, pending in self.pending.values():
            if pending.proc.poll() is None:
                pending.proc.kill()
            pending.proc.communicate()
        self.pending.clear()


@pytest.fixture(scope="session")
def _miles_dry_prefetch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                        miles_repo_root: Path):
    if hasattr(request.config, "workerinput") or len(request.session.items) < 2:
        yield None
        return
    prefetch = _DryPrefetch(request.session, tmp_path_factory.mktemp("dry-prefetch"), miles_repo_root)
    yield prefetch
    prefetch.close()


@pytest.fixture
def dry_run(tmp_path: Path, miles_repo_root: Path, request: pytest.FixtureRequest, _miles_dry_prefetch):
    """`dry_run(case)`: run the recipe with submission off and return its `DryRun` (plan, text,
    output). Fails the test with the recipe's output when the recipe fails."""
    counter = iter(range(10_000))

    def run(case: RecipeCase | None = None, *, expect_failure: bool = False, **kw):
        """With expect_failure=True the recipe must fail: its DryCheckFailure is returned (with
        `.dry`, the run, when it left a plan), and a recipe that succeeds fails the test."""
        case = case or request.getfixturevalue("recipe_case")
        try:
            pending = _miles_dry_prefetch.take(case) if (_miles_dry_prefetch and not kw) else None
            if pending is not None:
                done = pending.result()
            else:
                done = run_dry(case, tmp_path / f"dry{next(counter)}", rootdir=miles_repo_root, **kw)
        except DryCheckFailure as e:
            if expect_failure:
                return e
            failure = str(e)
        else:
            if not expect_failure:
                return done
            failure = f"dry run of {case.script} was expected to fail but succeeded"
        pytest.fail(failure, pytrace=False)

    return run


@pytest.fixture
def plan_snapshot(snapshot) -> PlanSnapshotAssertion:
    """syrupy's `snapshot`, storing a plan as one readable `.txt` file per case."""
    return plan_snapshot_from(snapshot)


@pytest.fixture
def check_static():
    """`check_static(dry)`: validate the argv in process and assert the static invariants."""

    def check(dry, validate=None):
        try:
            return dry.check_static(validate)
        except DryCheckFailure as e:
            failure = str(e)
        pytest.fail(failure, pytrace=False)

    return check


def _needed_gpus(request: pytest.FixtureRequest) -> int:
    marker = request.node.get_closest_marker("gpu")
    if marker is not None:
        return int(marker.args[0] if marker.args else marker.kwargs.get("n", 1))
    case = case_of(request.node)
    return case.gpus if case is not None else 1


@pytest.fixture
def gpu_lease(request: pytest.FixtureRequest):
    """GPUs leased for this test (count from its `gpu(n)` marker); `.devices` is the
    `--cuda-visible-devices` value. Skips when NVML is missing or too few GPUs are free."""
    needed = _needed_gpus(request)
    config = request.config
    try:
        lease = lease_gpus(
            needed,
            lock_dir=Path(config.getoption("--miles-gpu-lock-dir")),
            max_used_mib=config.getoption("--miles-gpu-max-used-mib"),
            wait=config.getoption("--miles-gpu-wait"),
            shared=config.getoption("--miles-gpu-shared"),
        )
    except NoNvml as e:
        pytest.skip(f"GPU tier: {e}")
    except NotEnoughGpus as e:
        pytest.skip(str(e))
    with lease:
        yield lease


@pytest.fixture
def ray_cluster(tmp_path: Path):
    """`ray_cluster(nodes=2, cpus_per_node=4, token=None)`: a fresh Ray cluster on loopback with
    ports and a temp dir of its own; torn down (by token) after the test."""
    clusters: list[LocalRayCluster] = []

    def make(nodes: int = 2, cpus_per_node: int = 4, token: str | None = None) -> LocalRayCluster:
        cluster = LocalRayCluster(nodes=nodes, cpus_per_node=cpus_per_node, token=token or new_token())
        clusters.append(cluster)
        return cluster.start()

    yield make
    survivors = []
    for cluster in clusters:
        survivors += cluster.stop()[1]
    assert not survivors, "Ray cluster processes survived teardown:\n" + "\n".join(survivors)


@pytest.fixture(scope="session")
def shared_ray_cluster():
    """One loopback Ray node per pytest(-xdist) worker for its CPU-tier cases: started when a case
    needs it, ended (by its token) once no case has used it for `miles.testing.idle.IDLE_S` and at
    the end of the session. It advertises this machine's CPUs, as a head the launcher starts for
    a CPU job would, so placements are the same. `with shared_ray_cluster.using() as cluster:`."""
    survivors: list[str] = []

    def start() -> LocalRayCluster:
        return LocalRayCluster(nodes=1, cpus_per_node=os.cpu_count() or 1, token=new_token()).start()

    def stop(cluster: LocalRayCluster) -> None:
        survivors.extend(cluster.stop()[1])

    def wanted_by(item: pytest.Item) -> bool:
        case = case_of(item)
        return case is not None and case.uses_shared_cluster

    service = IdleEnded(start, stop, wanted_by)
    yield service
    service.close()
    assert not survivors, "shared Ray cluster processes survived teardown:\n" + "\n".join(survivors)


@pytest.fixture
def run_recipe(request: pytest.FixtureRequest, tmp_path: Path, miles_repo_root: Path, model_cache_dir: Path):
    """`run_recipe(case=None, *, extra_args=(), env=None, check=True) -> RecipeRun`.

    Runs the recipe for real: GPUs from `gpu_lease` for a GPU case, a loopback cluster for a
    case with `ray_nodes`, its own output dir, the shared checkpoint cache, a unique token. Ends
    everything it started and asserts nothing carrying the token survived. With check=True a
    failed or timed-out run fails the test with the log tail, argv and provenance.
    """
    counter = iter(range(10_000))
    runs = request.node.stash.setdefault(_RUNS_KEY, [])

    def run(case: RecipeCase | None = None, *, extra_args=(), env=None, check: bool = True) -> RecipeRun:
        case = case or request.getfixturevalue("recipe_case")
        extra = list(extra_args)
        run_env = {"MILES_SCRIPT_MODEL_DIR": str(model_cache_dir)}
        if case.gpus:
            lease = request.getfixturevalue("gpu_lease")
            extra += ["--cuda-visible-devices", lease.devices]
        token = new_token()
        with ExitStack() as held:
            if case.ray_nodes:
                # a token of the cluster's own, as the shared cluster has: the run's token reaches the
                # job's driver and actors through the launcher, and the run's end must not SIGTERM the
                # cluster's daemons (they sit out the 10 s grace waiting on each other; the fixture
                # ends them with a short one)
                cluster = request.getfixturevalue("ray_cluster")(nodes=case.ray_nodes)
                run_env.update(cluster.env_for_recipe())
            elif case.uses_shared_cluster:
                shared = held.enter_context(request.getfixturevalue("shared_ray_cluster").using())
                run_env.update(shared.env_for_recipe())
            run_env.update(env or {})
            out = tmp_path / f"run{next(counter)}"
            result = _run_recipe(case, out, rootdir=miles_repo_root, token=token, extra_args=extra, env=run_env)
        runs.append(result)
        if result.survivors:
            pytest.fail(result.report(f"processes of {case.name} survived SIGKILL"), pytrace=False)
        if check and not result.ok:
            pytest.fail(result.report(), pytrace=False)
        return result

    return run


@pytest.fixture
def check_run(request: pytest.FixtureRequest):
    """`check_run(run, standard_case=None)`: assert the run invariants and compare its registered
    metrics with the committed standard (or record it under --miles-record-standards). A variant
    of a case that must reproduce the case's own standard names it as `standard_case`."""

    def check(run: RecipeRun, *, expect_fresh: bool = True, standard_case: RecipeCase | None = None) -> None:
        case = run.case
        metrics, run_json = run.metrics, run.run_json
        opt_dir = request.config.getoption("--miles-standards-dir")
        std_dir = Path(opt_dir) if opt_dir else Path(request.node.path).parent / "standards"
        path = standard_path(std_dir, standard_case or case)
        recording = request.config.getoption("--miles-record-standards")
        standard = load_standard(path) if case.metrics and not recording else {}
        if standard is None:
            pytest.fail(f"{case.name}: no committed metric standard at {path}.\n"
                        f"Record it (then review and commit it) with:\n    {record_command(request.node.nodeid)}",
                        pytrace=False)
        verdict = judge(case, metrics, run_json, standard) if standard else Verdict([], signal_problems(case, metrics))
        # the environment difference, when there is one, heads every failure report
        headline = f"{case.name}: {verdict.headline()}" if not verdict.strict else None
        problems = run_invariants(metrics, run_json, parity=case.parity, expect_fresh=expect_fresh)
        if problems:
            first = headline + "\n" if headline else ""
            pytest.fail(run.report(f"{first}{case.name}: run invariants violated:\n  - " + "\n  - ".join(problems),
                                   tail_lines=60), pytrace=False)
        if recording:
            _record_standard(run, path)
            return
        if verdict.problems:
            pytest.fail(
                f"{case.name}: {verdict.headline()}\n  - " + "\n  - ".join(verdict.problems)
                + (f"\nstandard: {path}\nIf the change is intended, re-record with:\n"
                   f"    {record_command(request.node.nodeid)}" if verdict.strict and case.metrics else "")
                + f"\nthis run's fingerprint: {json.dumps((run_json or {}).get('fingerprint'), sort_keys=True)}"
                + f"\nstandard's fingerprint: {json.dumps(standard.get('fingerprint'), sort_keys=True)}",
                pytrace=False)
        if headline:
            # passes on what holds anywhere, but never silently
            request.config.stash.setdefault(_ENV_NOTES_KEY, []).append(headline)
            warnings.warn(pytest.PytestWarning(headline))

    return check


def _record_standard(run: RecipeRun, path: Path) -> None:
    """Write the standard, unless it would pin nothing or the run lacks its learning signal."""
    case = run.case
    standard = build_standard(case, run.metrics, run.run_json)
    problems = constant_series(standard) + signal_problems(case, run.metrics)
    if not standard.get("fingerprint"):
        problems.append("run.json has no fingerprint: the standard could not say what it was recorded on")
    if problems:
        pytest.fail(f"{case.name}: refusing to record {path}:\n  - " + "\n  - ".join(problems), pytrace=False)
    write_standard(path, standard)


_PHASE_REPORTS: list[dict] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in getattr(report, "user_properties", ()):
        if name == "miles_phases":
            _PHASE_REPORTS.append(value)


def _print_phase_breakdown(terminalreporter) -> None:
    """Per real run: where its wall time went, so a suite-time regression shows in every log."""
    if not _PHASE_REPORTS:
        return
    terminalreporter.section("miles: where the real runs' time went")
    for entry in sorted(_PHASE_REPORTS, key=lambda e: -e["wall"]):
        terminalreporter.write_line(f"{entry['case']}: wall {entry['wall']:.1f}s")
        for label, seconds in entry["phases"]:
            terminalreporter.write_line(f"    {label:55s} {seconds:7.1f}s")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    _print_phase_breakdown(terminalreporter)
    notes = config.stash.get(_ENV_NOTES_KEY, [])
    if notes:
        terminalreporter.section("miles: standards compared across environments")
        for note in notes:
            terminalreporter.write_line(note)
