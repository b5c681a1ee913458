"""The launch plan: a machine-readable record of what a run does (docs/architecture.md section 6).

Written for every run, real or dry, to `<run_dir>/plan.json`. Secrets are redacted before they
get here: the plan is meant to be read, snapshotted and shared."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles.launcher.processes import write_text_atomically

PLAN_VERSION = 1
PLAN_FILE_NAME = "plan.json"


@dataclass
class LaunchPlan:
    recipe: str
    run_id: str
    run_dir: str
    train_script: str
    argv: list[str]
    locked_flags: dict[str, str | None]
    runtime_env: dict[str, Any]
    num_nodes: int
    num_gpus_per_node: int
    cuda_visible_devices: str | None
    external_ray: bool
    dry_run: bool
    ray: dict[str, Any]
    commands: list[str] = field(default_factory=list)
    # what the recipe ran through U.exec_command before the launch (prepare()'s downloads), in order
    prepare_commands: list[str] = field(default_factory=list)
    # flag -> the Hub repository and commit its value is a cached snapshot of (miles.records.hub_snapshots)
    hub_revisions: dict[str, dict] = field(default_factory=dict)
    memory_plan: list[str] = field(default_factory=list)  # per-GPU estimate per role (miles.plan.memory_plan)
    memory_plan_error: str | None = None  # set when the estimate is over budget: the launch is refused
    dry_run_decided_by: str = "default"  # MILES_SCRIPT_ENABLE_RAY_SUBMIT, ENABLE_RAY_SUBMIT or default
    # miles-diffusion's flags and train script as this launch took them (miles.flags.flag_vocabulary):
    # {"mapped": [...], "no_counterpart": [...], "train_script": "..."}; only the non-empty ones
    upstream_flags: dict[str, Any] = field(default_factory=dict)
    # gated Hub repositories the launch fetches: [{"repo", "licence" (its page), "token" (the variable)}]
    gated_assets: list[dict[str, str]] = field(default_factory=list)
    version: int = PLAN_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for optional in ("upstream_flags", "gated_assets"):  # written only when a launch has them
            if not data[optional]:
                del data[optional]
        return {"version": data.pop("version"), **data}

    def write(self) -> Path:
        from miles.launcher.env_vars import redact_text

        path = Path(self.run_dir) / PLAN_FILE_NAME
        # values of secrets found anywhere (a key inside a URL, a flag value) go too
        write_text_atomically(path, redact_text(json.dumps(self.to_dict(), indent=2)) + "\n")
        return path


def read_plan(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / PLAN_FILE_NAME).read_text())
