import gc

import pytest

from miles.utils.dotted_path import load_callable
from miles.utils.import_cost import collector_paused


def test_the_collector_is_paused_in_the_block_and_left_as_it_was_found_even_on_an_error():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner block does not resume it
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller that had paused it keeps it paused
    finally:
        gc.enable()


def test_a_dotted_path_imports_its_module_with_the_collector_paused(tmp_path, monkeypatch):
    (tmp_path / "import_cost_probe.py").write_text("import gc\nPAUSED = not gc.isenabled()\n\ndef f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_callable("import_cost_probe:f")() == 1
    import import_cost_probe

    assert import_cost_probe.PAUSED and gc.isenabled()


def test_loading_a_model_runs_with_the_collector_paused(tiny_checkpoint, monkeypatch):
    import miles.models.loader as loader

    seen = []
    real = loader._load_component
    monkeypatch.setattr(loader, "_load_component", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    loader.load_model(tiny_checkpoint("wan2_2"))
    assert seen and not any(seen) and gc.isenabled()
