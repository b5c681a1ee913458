
import numpy as np
import pytest
import torch
from PIL import Image

from miles.rollout.sample import image_grid, main
from miles.diffusion_facts.families import FAMILY_NAMES


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


def _sample(path, out, seed, *extra):
    main(["--hf-checkpoint", str(path), "--prompt", "a red cat", "--num-samples", "2", "--seed", str(seed),
          "--out", str(out), "--num-steps", "3", "--height", "32", "--width", "32", "--guidance-scale-2", "3.0",
          "--device", "cpu", *extra])
    return np.asarray(Image.open(out))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sample_writes_a_grid_and_the_same_seed_gives_the_same_pixels(family, checkpoint, tmp_path):
    first = _sample(checkpoint(family), tmp_path / "a.png", 0)
    again = _sample(checkpoint(family), tmp_path / "b.png", 0)
    other = _sample(checkpoint(family), tmp_path / "c.png", 1)
    video = family in ("wan2_2", "ltx", "ltx2")
    assert first.shape == ((2 * 32, 5 * 32, 3) if video else (32, 2 * 32, 3))  # frame strip per sample row
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_sample_of_wan_without_the_second_guidance_scale_is_an_error(checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--hf-checkpoint", str(checkpoint("wan2_2")), "--prompt", "p", "--out", str(tmp_path / "x.png"),
              "--device", "cpu"])
    assert exit.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "guidance-scale-2" in err[0]  # one line that names the flag
    assert not (tmp_path / "x.png").exists()


def test_image_grid_places_images_in_a_row_and_video_frames_along_each_row():
    images = [torch.full((3, 4, 5), v) for v in (0.0, 1.0, 0.5)]
    grid = np.asarray(image_grid(images))
    assert grid.shape == (4, 15, 3) and grid[0, 0, 0] == 0 and grid[0, 5, 0] == 255 and grid[0, 10, 0] == 128
    videos = [torch.zeros(6, 3, 4, 5), torch.ones(6, 3, 4, 5)]
    grid = np.asarray(image_grid(videos))
    assert grid.shape == (8, 30, 3) and grid[0, 29, 0] == 0 and grid[4, 0, 0] == 255
