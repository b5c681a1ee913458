"""No flag is accepted and ignored: every flag of train_diffusion.py names a test of its effect.

The registry (tests/unit/flags/flag_effects.py) maps each flag to the node id of a test that
observes what the flag does, or that the parser refuses the values the trainer cannot honour.
This test fails for a flag without an entry, for an entry naming no flag, and for an entry whose
test is gone (deleting or renaming a flag's test fails here).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from miles.flags.arguments import build_parser

ROOT = Path(__file__).resolve().parents[3]


def _registry() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("flag_effects", Path(__file__).with_name("flag_effects.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FLAG_TESTS


def parser_flags() -> list[str]:
    """Each flag once, by its positive spelling (`--colocate`, not `--no-colocate`)."""
    flags = []
    for action in build_parser()._actions:
        if action.dest == "help" or not action.option_strings:
            continue
        flags.append(next(f for f in action.option_strings if not f.startswith("--no-")))
    return flags


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{f.name}" for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return {n for n in names if n.split("::")[-1].startswith("test")}


def missing_tests(registry: dict[str, str], root: Path = ROOT) -> dict[str, str]:
    """flag -> why its registered test does not exist."""
    problems = {}
    for flag, nodeid in registry.items():
        path, _, name = nodeid.partition("::")
        if not (root / path).is_file():
            problems[flag] = f"{nodeid}: no file {path}"
        elif name not in defined_tests(root / path):
            problems[flag] = f"{nodeid}: no test {name} in {path}"
    return problems


def test_every_flag_has_a_registered_test_of_its_effect():
    registry, flags = _registry(), parser_flags()
    unregistered = [f for f in flags if f not in registry]
    assert not unregistered, (f"flags with no registered test of their effect or refusal: {unregistered}; add "
                              f"one to tests/unit/flags/flag_effects.py (or make the parser refuse the flag)")
    stale = sorted(set(registry) - set(flags))
    assert not stale, f"registered flags the parser no longer has: {stale}"


def test_every_registered_test_exists():
    problems = missing_tests(_registry())
    assert not problems, "\n".join(f"{flag}: {why}" for flag, why in problems.items())


def test_removing_a_flags_test_fails_the_check(tmp_path):
    test_file = tmp_path / "tests" / "test_x.py"
    test_file.parent.mkdir()
    test_file.write_text("def test_effect():\n    pass\n\nclass TestK:\n    def test_m(self):\n        pass\n")
    registry = {"--a": "tests/test_x.py::test_effect", "--b": "tests/test_x.py::TestK::test_m"}
    assert missing_tests(registry, tmp_path) == {}
    test_file.write_text("def test_other():\n    pass\n")
    assert set(missing_tests(registry, tmp_path)) == {"--a", "--b"}
    assert "no test test_effect" in missing_tests(registry, tmp_path)["--a"]


@pytest.mark.parametrize("flag", ["--sequence-parallel-size", "--rollout-num-gpus-per-engine"])
def test_unimplemented_values_are_refused_naming_what_is_supported(flag):
    from miles.flags.arguments import ConfigError, parse_args

    argv = f"--hf-checkpoint /c/sd3 --num-rollout 1 --rm-type brightness --prompt-data p.jsonl {flag} 2"
    with pytest.raises(ConfigError, match=f"{flag} 2: .*use 1"):
        parse_args(argv.split() + ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"])
