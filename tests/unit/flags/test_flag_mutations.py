"""The mutation check (tests/tools/mutation_check.py) stays usable: every anchor matches today's
source, every flag the issue names has a mutation, and the source comes back on every exit path.

The check itself (each registered test failing under its mutation) runs the trainer many times;
run it with `flock /tmp/miles-heavy.lock python3 -m tests.tools.mutation_check`.
"""

from __future__ import annotations

import pytest

from tests.tools import mutation_check as mc

REQUIRED = ("--diffusion-clip-range", "--diffusion-kl-beta", "--diffusion-kl-reference", "--use-ema", "--lora-alpha",
            "--eval-num-prompts", "--weight-sync", "--lr-decay-style", "--micro-batch-size",
            "--diffusion-noise-level", "--diffusion-guidance-scale")


def test_every_required_flag_has_a_mutation_and_a_registered_test():
    flags = {m.flag for m in mc.MUTATIONS}
    assert set(REQUIRED) <= flags
    assert flags <= set(mc.registry())


@pytest.mark.parametrize("mutation", mc.MUTATIONS, ids=lambda m: m.flag)
def test_every_anchor_matches_the_source_and_changes_it(mutation):
    source = (mc.ROOT / mutation.path).read_text()
    assert mc.mutate(source, mutation) != source


def _copy(tmp_path, mutation):
    target = tmp_path / mutation.path
    target.parent.mkdir(parents=True)
    target.write_bytes((mc.ROOT / mutation.path).read_bytes())
    return target


def test_the_source_is_restored_after_a_failing_run_and_after_an_exception(tmp_path):
    mutation = mc.MUTATIONS[0]
    target = _copy(tmp_path, mutation)
    original = target.read_bytes()
    seen = []
    with mc.mutated(tmp_path, mutation):
        seen.append(target.read_bytes())
    assert seen[0] != original and target.read_bytes() == original
    with pytest.raises(KeyboardInterrupt):
        with mc.mutated(tmp_path, mutation):
            raise KeyboardInterrupt
    assert target.read_bytes() == original


def test_a_test_that_passes_under_its_mutation_is_reported_as_not_observing_the_flag(tmp_path):
    mutation = mc.MUTATIONS[0]
    _copy(tmp_path, mutation)
    registry_file = tmp_path / "tests/unit/flags/flag_effects.py"
    registry_file.parent.mkdir(parents=True)
    registry_file.write_text(f"FLAG_TESTS = {{{mutation.flag!r}: 'tests/x.py::test_x'}}\n")
    rows = mc.check([mutation], tmp_path, run=lambda root, nodeid: True)
    assert rows[0][2].startswith("PASSED") and "NO:" in mc.table(rows)
    target = tmp_path / mutation.path
    original = target.read_bytes()
    # passes on the untouched source, fails on the mutated one: the wanted outcome
    rows = mc.check([mutation], tmp_path, run=lambda root, nodeid: target.read_bytes() == original)
    assert rows[0][2] == "failed" and "| yes |" in mc.table(rows)
    # a test that fails anyway proves nothing about its flag
    rows = mc.check([mutation], tmp_path, run=lambda root, nodeid: False)
    assert rows[0][2].startswith("BASELINE FAILED") and "NO:" in mc.table(rows)


def test_an_anchor_that_no_longer_matches_is_reported_and_nothing_is_written(tmp_path):
    mutation = mc.Mutation("--use-ema", mc.MUTATIONS[0].path, r"\bargs\.no_such_flag\b", "0", "nothing")
    target = _copy(tmp_path, mutation)
    original = target.read_bytes()
    registry_file = tmp_path / "tests/unit/flags/flag_effects.py"
    registry_file.parent.mkdir(parents=True)
    registry_file.write_text("FLAG_TESTS = {'--use-ema': 'tests/x.py::test_x'}\n")
    rows = mc.check([mutation], tmp_path, run=lambda root, nodeid: pytest.fail("must not run"), baseline=False)
    assert rows[0][2].startswith("ANCHOR MISSING") and target.read_bytes() == original
