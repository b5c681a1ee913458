"""Launch plans as readable, machine-independent text, and the syrupy extension storing them.

A plan (`<run_dir>/plan.json`, written by the launcher) becomes a text file with one flag per
line, so a recipe edit shows up in review and in a failing test as a one-line diff. Everything
that differs between two runs of the same recipe — temporary paths, run ids, host names, ports,
tokens and secrets — is replaced by a placeholder before the text is compared.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
from pathlib import Path
from typing import Iterable, Mapping

from syrupy.assertion import DiffMode, SnapshotAssertion
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

# The launcher's one secret rule (names and value redaction): a snapshot hides exactly what the
# launcher's options table, EXEC lines, plan and job log hide, and nothing is decided here.
from miles.launcher.env_vars import REDACTED, is_secret_name, redact_text, secret_values
from miles.testing.cases import command_line_id

_PORT_FLAG = re.compile(r"(--[\w-]*port[= ])\d+")
_HOST_PORT = re.compile(r"((?:127\.0\.0\.1|localhost|0\.0\.0\.0|<HOST>|<IP>)):\d{1,5}\b")
_IPV4 = re.compile(r"\b(?!127\.0\.0\.1\b)(?!0\.0\.0\.0\b)(?:\d{1,3}\.){3}\d{1,3}\b")
# NAME=value anywhere in a line (an EXEC line's env prefix): hidden when NAME is a secret name
_ASSIGN = re.compile(r"(?<![\w.-])([A-Za-z_][A-Za-z0-9_]*)=(\S+)")


class Normalizer:
    """Replaces machine- and run-specific substrings with stable placeholders."""

    def __init__(self, replacements: Mapping[str, str] | None = None, secrets: Iterable[str] = ()):
        """`secrets`: values to hide wherever they appear (`secret_values_from_env()` gives those of
        this process's environment); they are filtered by the launcher's rule for searchable values."""
        pairs: dict[str, str] = {}
        for raw, placeholder in (replacements or {}).items():
            if not raw:
                continue
            pairs[str(raw)] = placeholder
            try:  # the same path as the OS spells it (/tmp vs /private/tmp, symlinks)
                resolved = str(Path(raw).resolve())
                if resolved != str(raw) and os.path.isabs(str(raw)):
                    pairs.setdefault(resolved, placeholder)
            except (OSError, RuntimeError):
                pass
        hosts = {socket.gethostname(), socket.getfqdn()} - {"", "localhost"}
        # Host names only as whole words: a short host name must not eat parts of paths.
        self._hosts = [re.compile(rf"(?<![\w.-]){re.escape(h)}(?![\w-])") for h in hosts if len(h) >= 2]
        self._secrets = [str(v) for v in secrets if v]
        # Longest first so a run dir is replaced before the output dir that contains it.
        self._pairs = sorted(pairs.items(), key=lambda kv: len(kv[0]), reverse=True)

    def text(self, s: str) -> str:
        s = redact_text(s, self._secrets)  # the launcher's value redaction, first: a path may hold one
        for raw, placeholder in self._pairs:
            s = s.replace(raw, placeholder)
        for host in self._hosts:
            s = host.sub("<HOST>", s)
        s = _PORT_FLAG.sub(r"\1<PORT>", s)
        s = _HOST_PORT.sub(r"\1:<PORT>", s)
        s = _IPV4.sub("<IP>", s)
        s = _ASSIGN.sub(
            lambda m: f"{m.group(1)}={REDACTED}" if is_secret_name(m.group(1)) else m.group(0), s
        )
        return s

    def env_value(self, name: str, value: str) -> str:
        if is_secret_name(name):
            return REDACTED
        return self.text(str(value))


def secret_values_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of this environment's secret-named variables, by the launcher's rule."""
    return secret_values(environ=os.environ if environ is None else environ)


def group_flags(argv: Iterable[str]) -> list[list[str]]:
    """Split an argv into `[flag, values...]` groups: a token starting with `--` opens a group.
    Tokens before the first flag form their own groups, one per token."""
    groups: list[list[str]] = []
    for tok in argv:
        tok = str(tok)
        if tok.startswith("--") or not groups or not groups[-1][0].startswith("--"):
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return groups


def _quote(token: str) -> str:
    if re.fullmatch(r"<[A-Za-z_]+>", token):
        return token  # a placeholder reads better bare
    return shlex.quote(token) if token else "''"


def _line(group: list[str]) -> str:
    return " ".join(_quote(t) for t in group)


def _is_subsequence_at(tokens: list[str], sub: list[str]) -> int:
    n = len(sub)
    if not n:
        return -1
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i : i + n] == sub:
            return i
    return -1


_SCALARS = ("recipe", "train_script", "num_nodes", "num_gpus_per_node", "cuda_visible_devices",
            "external_ray", "dry_run")
_SKIP = {"version", "run_id", "run_dir", "argv", "locked_flags", "runtime_env", "commands", "ray", "memory_plan",
         "memory_plan_error", "prepare_commands",
         "hub_revisions",  # the commits this machine's cache holds: not the same on every machine
         "gated_assets"}  # plan.json names the licence pages; a snapshot keeps to the recipe's flags and commands


def render_plan(plan: Mapping, norm: Normalizer | None = None) -> str:
    """The plan as text: scalars, then [argv] one flag per line, [locked_flags], [env] sorted,
    [ray] settings and [commands] with the train argv elided (it is shown above)."""
    norm = norm or Normalizer()
    out: list[str] = []
    for key in _SCALARS:
        if key in plan:
            out.append(f"{key}: {norm.text(json.dumps(plan[key]))}")
    for key in sorted(k for k in plan if k not in _SCALARS and k not in _SKIP):
        out.append(f"{key}: {norm.text(json.dumps(plan[key], sort_keys=True))}")

    argv = [str(a) for a in plan.get("argv", [])]
    out += ["", "[argv]"]
    out += [norm.text(_line(g)) for g in group_flags(argv)]

    prepared = plan.get("prepare_commands") or []
    if prepared:  # what prepare() ran or would run (downloads), before the launch
        out += ["", "[prepare]"]
        out += [f"$ {norm.text(str(cmd))}" for cmd in prepared]

    locked = plan.get("locked_flags") or {}
    if locked:
        out += ["", "[locked_flags]"]
        for flag in sorted(locked):
            value = locked[flag]
            values = value if isinstance(value, list) else [value]
            out.append(norm.text(_line([flag, *[str(v) for v in values if v is not None]])))

    env = ((plan.get("runtime_env") or {}).get("env_vars")) or {}
    if env:
        out += ["", "[env]"]
        out += [f"{k}={norm.env_value(k, str(v))}" for k, v in sorted(env.items())]

    ray = plan.get("ray") or {}
    if ray:
        out += ["", "[ray]"]
        for k in sorted(ray):
            v = ray[k]
            if "port" in k:
                continue  # ports are picked at start; the ray start command shows which are set
            if isinstance(v, list) and v:  # one entry a line (the ports a head opens)
                out.append(f"{k}:")
                out += [f"  - {norm.text(json.dumps(item, sort_keys=True))}" for item in v]
                continue
            text = json.dumps(v, sort_keys=True)
            out.append(f"{k}: {norm.text(text)}")

    memory = plan.get("memory_plan") or []
    if memory:
        out += ["", "[memory_plan]"]
        out += [norm.text(str(line)) for line in memory]

    commands = plan.get("commands") or []
    if commands:
        out += ["", "[commands]"]
        for cmd in commands:
            try:
                tokens = shlex.split(cmd) if isinstance(cmd, str) else [str(t) for t in cmd]
            except ValueError:
                out.append(norm.text(str(cmd)))
                continue
            at = _is_subsequence_at(tokens, argv)
            if at >= 0:
                tokens = tokens[:at] + ["<argv>"] + tokens[at + len(argv):]
            lead = 0
            while lead < len(tokens) and not tokens[lead].startswith("--"):
                lead += 1
            out.append("$ " + norm.text(_line(tokens[:lead])))
            out += ["    " + norm.text(_line(g)) for g in group_flags(tokens[lead:])]
    return "\n".join(out) + "\n"


class PlanSnapshotExtension(SingleFileSnapshotExtension):
    """One `.txt` file per case under `__snapshots__/<test module>/`, stored as text."""

    _write_mode = WriteMode.TEXT
    file_extension = "txt"


class PlanSnapshotAssertion(SnapshotAssertion):
    """syrupy's assertion whose failure report says how to record a missing snapshot."""

    def get_assert_diff(self, *, diff_mode: DiffMode = DiffMode.DETAILED) -> list[str]:
        lines = super().get_assert_diff(diff_mode=diff_mode)
        result = self._execution_results.get(self.num_executions - 1)
        if result is not None and result.recalled_data is None and not result.exception:
            nodeid = command_line_id(self.test_location.nodeid)
            lines = [
                f"No plan snapshot is recorded for {nodeid}.",
                "Record it (then review and commit the new file) with:",
                f"    pytest {shlex.quote(nodeid)} --snapshot-update",
            ] + lines[1:]
        return lines

    def snapshot_path(self) -> Path:
        return Path(self.extension.get_location(test_location=self.test_location, index=self.index))

    def exists(self) -> bool:
        return self.snapshot_path().is_file()


def plan_snapshot_from(snapshot: SnapshotAssertion) -> PlanSnapshotAssertion:
    return PlanSnapshotAssertion(
        session=snapshot.session,
        extension_class=PlanSnapshotExtension,
        test_location=snapshot.test_location,
        update_snapshots=snapshot.update_snapshots,
        update_new_snapshots_only=snapshot.update_new_snapshots_only,
    )
