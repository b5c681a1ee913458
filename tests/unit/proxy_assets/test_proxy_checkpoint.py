import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.proxy_assets import checkpoint as cc
from miles.proxy_assets.checkpoint import build_component, create_checkpoint, ensure_checkpoint
from miles.models.registry import get_family

from miles.diffusion_facts.families import FAMILY_NAMES as FAMILIES


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", FAMILIES)
def test_create_checkpoint_twice_writes_byte_identical_directories(family, tmp_path, tiny_checkpoint):
    # the other build is the run's shared seed-0 checkpoint, often made by another xdist worker:
    # the same bytes across processes, not only within one
    a = _tree(create_checkpoint(family, "tiny", 0, tmp_path / "a"))
    b = _tree(tiny_checkpoint(family))
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []
    assert "model_index.json" in a and "scheduler/scheduler_config.json" in a
    for component in get_family(family).transformer_components + ("text_encoder", "vae"):
        assert f"{component}/config.json" in a
        assert any(k.startswith(f"{component}/") and k.endswith(".safetensors") for k in a)


def test_diffusers_layout_names_classes_and_family_shift(tiny_checkpoint):
    path = tiny_checkpoint("wan2_2")
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["transformer"] == index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["boundary_ratio"] == 0.875
    assert json.loads((path / "scheduler/scheduler_config.json").read_text())["shift"] == 12.0
    assert (path / "tokenizer/tokenizer.json").is_file()


def test_different_seeds_give_different_weights(tmp_path, tiny_checkpoint):
    a = tiny_checkpoint("wan2_2")
    b = create_checkpoint("wan2_2", "tiny", 1, tmp_path / "b")  # no VAE fit: a build in a fraction of a second
    name = "transformer/diffusion_pytorch_model.safetensors"
    wa, wb = load_file(a / name), load_file(b / name)
    assert not torch.equal(wa["proj_out.weight"], wb["proj_out.weight"])


def test_a_failed_build_leaves_no_checkpoint_behind(tmp_path, monkeypatch):
    def broken(family, size, seed, out):
        (out / "transformer").mkdir(parents=True)
        raise RuntimeError("disk full")

    monkeypatch.setattr(cc, "_write_checkpoint", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        create_checkpoint("sd3", "tiny", 0, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


def test_existing_checkpoint_is_not_overwritten_without_asking(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(FileExistsError):
        create_checkpoint("sd3", "tiny", 0, tmp_path / "ck")


def test_ensure_checkpoint_builds_once_under_its_conventional_name(tmp_path, monkeypatch):
    calls = []
    real = cc.create_checkpoint
    monkeypatch.setattr(cc, "create_checkpoint", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = ensure_checkpoint("wan2_2", "tiny", 5, tmp_path)  # no VAE fit: a build in a fraction of a second
    second = ensure_checkpoint("wan2_2", "tiny", 5, tmp_path)
    assert first == second == tmp_path / "miles-wan2_2-tiny-seed5"
    assert len(calls) == 1


def test_command_line_builds_a_checkpoint(tmp_path, capsys):
    cc.main(["--family", "qwen_image", "--size", "tiny", "--seed", "0", "--out", str(tmp_path / "qwen")])
    assert (tmp_path / "qwen" / "model_index.json").is_file()
    assert str(tmp_path / "qwen") in capsys.readouterr().out


def _parameters(spec) -> int:
    with torch.device("meta"):
        module = build_component(spec, seed=0)
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_proxy_size_builds_the_same_classes_much_larger(family):
    tiny, proxy = get_family(family).module.components("tiny"), get_family(family).module.components("proxy")
    assert tiny.keys() == proxy.keys()
    for name in get_family(family).transformer_components:
        assert tiny[name].class_name == proxy[name].class_name
        assert _parameters(proxy[name]) > 300e6 > 1e6 > _parameters(tiny[name])
