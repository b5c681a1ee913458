import json

import numpy as np
import pytest
from PIL import Image

from miles.rollout.data import read_prompt_file
from miles.proxy_assets.prompts import ensure_prompt_file, ensure_sft_dataset
from miles.rollout.rm_hub.colors import find_color


@pytest.mark.parametrize("kind", ["tiny", "ocr", "general"])
def test_prompt_file_is_byte_identical_for_same_arguments(tmp_path, kind):
    a = ensure_prompt_file(kind, tmp_path / "a.jsonl", 40, seed=1)
    b = ensure_prompt_file(kind, tmp_path / "b.jsonl", 40, seed=1)
    c = ensure_prompt_file(kind, tmp_path / "c.jsonl", 40, seed=2)
    assert a.read_bytes() == b.read_bytes()
    assert len(read_prompt_file(a)) == 40
    if kind != "tiny":  # tiny cycles colours; its wording still depends on the seed
        assert a.read_bytes() != c.read_bytes()


def test_prompt_file_is_rewritten_when_its_content_differs(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("garbage\n")
    ensure_prompt_file("tiny", path, 5)
    assert len(read_prompt_file(path)) == 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_ocr_prompts_quote_the_word_named_in_metadata(tmp_path):
    for item in read_prompt_file(ensure_prompt_file("ocr", tmp_path / "o.jsonl", 25)):
        assert f'"{item.metadata["text"]}"' in item.prompt


def test_tiny_prompts_name_the_colour_in_metadata(tmp_path):
    items = read_prompt_file(ensure_prompt_file("tiny", tmp_path / "t.jsonl", 22))
    assert all(find_color(i.prompt) == i.metadata["color"] for i in items)
    assert len({i.metadata["color"] for i in items}) > 5


def test_general_prompts_are_varied(tmp_path):
    items = read_prompt_file(ensure_prompt_file("general", tmp_path / "g.jsonl", 30))
    assert len({i.prompt for i in items}) >= 25


def test_unknown_kind_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt kind 'nope'"):
        ensure_prompt_file("nope", tmp_path / "x.jsonl", 3)


def _tree_bytes(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_sft_image_dataset_is_deterministic_and_matches_its_prompts(tmp_path):
    a = ensure_sft_dataset(tmp_path / "a", "sd3", 4, 16, 24, frames=5, seed=0)
    b = ensure_sft_dataset(tmp_path / "b", "sd3", 4, 16, 24, frames=5, seed=0)
    assert _tree_bytes(a.parent) == _tree_bytes(b.parent)
    for line in a.read_text().splitlines():
        rec = json.loads(line)
        pixels = np.asarray(Image.open(a.parent / rec["media"]))
        assert pixels.shape == (16, 24, 3) and rec["frames"] == 1  # image family ignores frames
        start, end = rec["prompt"].split(" from ")[1].split(" to ")
        first, last = (pixels[:, 0], pixels[:, -1]) if "horizontal" in rec["prompt"] else (pixels[0], pixels[-1])
        assert find_color(start) != find_color(end)
        assert np.allclose(first.mean(0) / 255, _rgb(start), atol=0.02)
        assert np.allclose(last.mean(0) / 255, _rgb(end), atol=0.02)


def _rgb(name):
    from miles.rollout.rm_hub.colors import COLORS

    return np.array(COLORS[name])


def test_sft_video_dataset_stores_a_frame_strip_beside_a_jsonl_path(tmp_path):
    jsonl = ensure_sft_dataset(tmp_path / "v.jsonl", "wan2_2", 2, 8, 12, frames=3, seed=0)
    rec = json.loads(jsonl.read_text().splitlines()[0])
    assert rec["media"].startswith("v_media/") and rec["frames"] == 3
    strip = np.asarray(Image.open(jsonl.parent / rec["media"]))
    assert strip.shape == (8, 36, 3)
    assert not np.array_equal(strip[:, :12], strip[:, 12:24])  # frames move
