"""The GitHub workflows against the workflow schema that check-jsonschema ships (no network)."""

import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from check_jsonschema.builtin_schemas import get_builtin_schema
from ruamel.yaml import YAML

WORKFLOWS = Path(__file__).resolve().parents[3] / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))


def load(path):
    # YAML 1.2, as GitHub reads it: `on` stays a string key instead of turning into True
    return YAML(typ="safe").load(path.read_text())


def schema_errors(document):
    validator = jsonschema.Draft7Validator(get_builtin_schema("vendor.github-workflows"))
    return [e.message for e in validator.iter_errors(document)]


def test_both_workflows_exist():
    assert {p.name for p in FILES} >= {"nightly-gpu.yml", "cpu.yml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_workflow_matches_the_vendored_schema(path):
    assert schema_errors(load(path)) == []


def test_check_jsonschema_cli_accepts_the_workflows():
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           "vendor.github-workflows", *map(str, FILES)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_check_rejects_a_broken_workflow():
    broken = load(WORKFLOWS / "cpu.yml")
    broken["jbos"] = broken.pop("jobs")
    assert any("jbos" in error for error in schema_errors(broken))


def test_nightly_runs_on_schedule_and_dispatch_on_a_self_hosted_gpu_runner():
    flow = load(WORKFLOWS / "nightly-gpu.yml")
    assert flow["on"]["schedule"][0]["cron"] and "workflow_dispatch" in flow["on"]
    (job,) = flow["jobs"].values()
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    scripts = "\n".join(step.get("run", "") for step in job["steps"])
    assert "ci/run_suite.py" in scripts and "--history-db" in scripts
    assert "--miles-record-standards" not in scripts and "record_standards" not in scripts
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    for wanted in ("junit.xml", "summary.md", "logs/"):
        assert wanted in upload["with"]["path"]


def test_cpu_workflow_runs_ci_run_on_pull_requests():
    flow = load(WORKFLOWS / "cpu.yml")
    assert "pull_request" in flow["on"]
    (job,) = flow["jobs"].values()
    assert any(step.get("run", "").strip() == ".ci/run" for step in job["steps"])
