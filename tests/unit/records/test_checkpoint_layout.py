"""Issue 27 point 2: what makes a checkpoint complete, and the pixel grid its VAE and patch allow."""

from __future__ import annotations

import json
import shutil

import pytest

from miles.proxy_assets import is_current_checkpoint
from miles.records.checkpoint_layout import PixelGrid, missing_parts, pixel_grid


@pytest.fixture
def sd3_copy(tiny_checkpoint, tmp_path):
    path = tmp_path / "miles-sd3-tiny-seed0"
    shutil.copytree(tiny_checkpoint("sd3"), path)
    return path


@pytest.mark.parametrize("damage,expected", [
    (lambda p: shutil.rmtree(p / "vae"), "vae/ (a AutoencoderKL) is missing"),
    (lambda p: (p / "transformer" / "diffusion_pytorch_model.safetensors").unlink(), "transformer/ holds no weights"),
    (lambda p: (p / "text_encoder" / "config.json").unlink(), "text_encoder/config.json is missing"),
    (lambda p: (p / "scheduler" / "scheduler_config.json").unlink(), "scheduler/scheduler_config.json is missing"),
    (lambda p: (p / "model_index.json").unlink(), "model_index.json is missing"),
])
def test_an_incomplete_cached_checkpoint_is_named_and_rebuilt_not_reused(sd3_copy, damage, expected):
    assert missing_parts(sd3_copy, ("vae", "transformer")) == [] and is_current_checkpoint(sd3_copy, "tiny")
    damage(sd3_copy)
    assert any(expected in problem for problem in missing_parts(sd3_copy, ("vae", "transformer")))
    assert not is_current_checkpoint(sd3_copy, "tiny")  # the recipe's ensure_checkpoint builds it again


def test_a_component_the_family_needs_but_the_index_omits_is_missing(sd3_copy):
    index = json.loads((sd3_copy / "model_index.json").read_text())
    del index["vae"]
    (sd3_copy / "model_index.json").write_text(json.dumps(index))
    assert missing_parts(sd3_copy, ("vae",)) == ["vae/ is not named in model_index.json"]


def test_the_pixel_grid_is_the_vae_downsampling_times_the_patch(sd3_copy, tmp_path):
    grid = pixel_grid(sd3_copy)  # AutoencoderKL with 4 blocks (x8), patch 2
    assert grid == PixelGrid(16) and grid.nearest(63) == (48, 64) and grid.nearest(5) == (16, 32)
    wan = tmp_path / "wan"
    (wan / "vae").mkdir(parents=True)
    (wan / "transformer").mkdir()
    (wan / "vae" / "config.json").write_text(json.dumps({"temperal_downsample": [False, True, True]}))
    (wan / "transformer" / "config.json").write_text(json.dumps({"patch_size": [1, 2, 2]}))
    video = pixel_grid(wan)  # x8 spatial, x4 temporal: frames 1 + 4k
    assert video == PixelGrid(16, 4, 1)
    assert video.frames_ok(33) and not video.frames_ok(32) and video.nearest_frames(32) == (29, 33)


def _cosmos_index(path, concat_padding_mask: bool):
    """The JSON files of a Cosmos checkpoint, enough for the layout's questions (no weights read)."""
    path.mkdir()
    (path / "model_index.json").write_text(json.dumps({"_class_name": "Cosmos2TextToImagePipeline",
                                                       "transformer": ["diffusers", "CosmosTransformer3DModel"],
                                                       "vae": ["diffusers", "AutoencoderKLWan"]}))
    (path / "transformer").mkdir()
    (path / "transformer" / "config.json").write_text(json.dumps({"concat_padding_mask": concat_padding_mask}))
    return path


def test_a_released_cosmos_transformer_needs_torchvision_and_the_proxies_do_not(tmp_path, tiny_checkpoint):
    from miles.records.checkpoint_layout import libraries_needed

    released = _cosmos_index(tmp_path / "released", concat_padding_mask=True)
    assert libraries_needed(released) == {"torchvision": "transformer/ (CosmosTransformer3DModel with concat_padding_mask)"}
    assert libraries_needed(_cosmos_index(tmp_path / "proxy", concat_padding_mask=False)) == {}
    assert libraries_needed(tiny_checkpoint("cosmos3")) == {}  # our proxies build without the mask


def test_the_preflight_refuses_a_checkpoint_whose_optional_library_is_missing_naming_it_and_the_fix(
        tmp_path, monkeypatch):
    from importlib.machinery import PathFinder

    from miles.records import checkpoint_layout
    from miles.launcher import preflight

    released = _cosmos_index(tmp_path / "released", concat_padding_mask=True)
    # torchvision may or may not be installed where this runs: the refusal is shown with a library
    # that surely is not, and torchvision's own verdict follows what this host has
    monkeypatch.setattr(checkpoint_layout, "OPTIONAL_LIBRARIES",
                        {("CosmosTransformer3DModel", "concat_padding_mask"): "miles_no_such_library"})
    with pytest.raises(preflight.PreflightError) as refused:
        preflight._check_libraries(released)
    assert "--hf-checkpoint" in str(refused.value) and "pip install miles_no_such_library" in str(refused.value)
    monkeypatch.undo()
    if PathFinder.find_spec("torchvision") is None:
        with pytest.raises(preflight.PreflightError, match="torchvision is not installed here"):
            preflight._check_libraries(released)
    else:
        preflight._check_libraries(released)
