import numpy as np
from PIL import Image

from miles.rollout.rm_hub.score import load_pixels, main


def test_frame_strip_and_npy_load_as_frames(tmp_path):
    strip = np.zeros((4, 9, 3), dtype=np.uint8)
    strip[:, 3:6] = 255
    Image.fromarray(strip).save(tmp_path / "s.png")
    frames = load_pixels(tmp_path / "s.png", frames=3)
    assert frames.shape == (3, 3, 4, 3) and frames[1].min() == 1.0 and frames[0].max() == 0.0
    np.save(tmp_path / "v.npy", np.full((2, 3, 4, 4), 0.5, dtype=np.float32))
    assert load_pixels(tmp_path / "v.npy").shape == (2, 3, 4, 4)


def test_score_command_prints_the_reward(tmp_path, capsys):
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "red.png")
    assert main(["--rm-type", "color_match", "--prompt", "a red car", "--image", str(tmp_path / "red.png")]) == 0
    assert float(capsys.readouterr().out) == 1.0


def test_score_command_reports_a_failing_custom_reward(tmp_path, capsys, custom_module):
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    code = main(["--custom-rm-path", f"{custom_module}:raises", "--prompt", "a bad sign", "--image", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 1
    assert "--custom-rm-path my_rewards:raises raised ValueError" in err and "sample 0 (prompt 'a bad sign')" in err


def test_score_command_refuses_a_misspelt_rm_type_at_parse_time_in_one_line(tmp_path):
    """The same registry check as train_diffusion.py's --rm-type: exit 2, one line, "did you mean"."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "miles.rollout.rm_hub.score", "--rm-type", "brightnes",
                          "--prompt", "p", "--image", str(tmp_path / "never-read.png")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "--rm-type" in lines[0] and "did you mean 'brightness'?" in lines[0]


def test_score_command_accepts_every_name_train_diffusion_accepts():
    from miles.rollout.rm_hub.registry import BUILTIN_REWARDS
    from miles.rollout.rm_hub.score import build_parser

    for name in [*BUILTIN_REWARDS, "custom", "pkg.mod:fn"]:
        assert build_parser().parse_args(["--rm-type", name, "--prompt", "p", "--image", "x.png"]).rm_type == name
