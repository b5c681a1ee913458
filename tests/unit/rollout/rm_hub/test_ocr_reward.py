import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from miles.rollout.rm_hub import RewardError, RewardSample, score_samples
from miles.rollout.rm_hub.ocr import edit_distance, quoted_text, text_score


def _font_path() -> Path:
    candidates = [Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    try:
        import matplotlib

        candidates.append(Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf")
    except ImportError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    pytest.skip("no DejaVuSans.ttf on this machine")


def render_text(text: str, size=(512, 256)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((40, 70), text, fill="black", font=ImageFont.truetype(str(_font_path()), 96))
    return image


def _chw(image: Image.Image) -> np.ndarray:
    return np.transpose(np.asarray(image, dtype=np.float32) / 255.0, (2, 0, 1))


def _noise(seed=0) -> np.ndarray:
    return np.random.default_rng(seed).random((3, 256, 512)).astype(np.float32)


def test_edit_distance_and_text_score():
    assert edit_distance("kitten", "sitting") == 3
    assert text_score("H E L L O", "hello") == 1.0
    assert text_score("HELO", "HELLO") == pytest.approx(0.8)
    assert text_score("", "HELLO") == 0.0
    assert text_score("completely different words", "HELLO") == 0.0  # floored, never negative


def test_quoted_text_finds_double_curly_and_single_quotes():
    assert quoted_text('a sign that says "HELLO"') == "HELLO"
    assert quoted_text("a mug with “CAFE” on it") == "CAFE"
    assert quoted_text("a sign reading 'OPEN' at the door's side") == "OPEN"
    assert quoted_text("no quote here") is None


def test_score_command_reads_rendered_hello_and_not_noise(tmp_path, make_args):
    hello, noise = tmp_path / "hello.png", tmp_path / "noise.png"
    render_text("HELLO").save(hello)
    Image.fromarray((_noise().transpose(1, 2, 0) * 255).astype(np.uint8)).save(noise)
    scores = []
    for image in (hello, noise):
        result = subprocess.run(
            [sys.executable, "-m", "miles.rollout.rm_hub.score", "--rm-type", "ocr",
             "--prompt", 'a sign that says "HELLO"', "--image", str(image)],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        scores.append(float(result.stdout.strip().splitlines()[-1]))
    assert scores[0] >= 0.9
    assert scores[1] <= 0.1


def test_video_scores_the_mean_over_frames_and_metadata_text_wins(make_args):
    hello = _chw(render_text("HELLO"))
    blank = np.ones_like(hello)
    video = RewardSample('a sign that says "WORLD"', np.stack([hello, blank]), {"text": "hello"})
    (score,) = asyncio.run(score_samples(make_args(rm_type="ocr"), [video]))
    assert score == pytest.approx(0.5, abs=0.05)


def test_prompt_without_quoted_text_names_the_sample(make_args):
    with pytest.raises(RewardError, match=r"'ocr'.*sample 0 \(prompt 'a sign'\)"):
        asyncio.run(score_samples(make_args(rm_type="ocr"), [RewardSample("a sign", _noise())]))


def _small(text: str) -> np.ndarray:
    """A 64 px frame, the CPU proxies' size: too small for the detector, read softly."""
    image = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(image).text((2, 18), text, fill="black", font=ImageFont.truetype(str(_font_path()), 22))
    return _chw(image)


def test_small_frame_soft_read_scores_the_right_letters_above_wrong_ones_and_noise():
    from miles.rollout.rm_hub.ocr import SOFT_READ_MAX_SIDE, frame_score

    frame = _small("HI")
    assert max(frame.shape[-2:]) <= SOFT_READ_MAX_SIDE
    right, wrong = frame_score(frame, "HI"), frame_score(frame, "QZ")
    noise = frame_score(_noise()[:, :64, :64], "HI")
    assert 0.5 < right <= 1.0
    assert wrong < 0.1 and noise < 0.2
    assert right > wrong and right > noise


def test_small_frames_of_a_tiny_model_get_distinct_non_zero_scores():
    """What the sd3 OCR CPU proxy trains on: dense scores, so advantages (and gradients) are non-zero."""
    from miles.rollout.rm_hub.ocr import frame_score

    rng = np.random.default_rng(0)
    blobs = [np.clip(rng.normal(0.5, 0.2, (3, 8, 8)).repeat(8, 1).repeat(8, 2), 0, 1).astype(np.float32)
             for _ in range(4)]
    scores = [frame_score(b, "OPEN") for b in blobs]
    assert all(0.0 < s < 1.0 for s in scores)
    assert len(set(scores)) == len(scores)
