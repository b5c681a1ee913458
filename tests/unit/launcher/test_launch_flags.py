import pytest

from miles.launcher.flags import (
    LockedFlagError,
    assemble_argv,
    check_locked_flags,
    flag_values,
    locked_flag_values,
)


def test_argv_is_run_dir_then_recipe_flags_then_extra_args_last():
    argv = assemble_argv("/out/run1", "--lr 1e-4 --diffusion-kl-beta 0.0", "--diffusion-kl-beta 0.02")
    assert argv == ["--run-dir", "/out/run1", "--lr", "1e-4", "--diffusion-kl-beta", "0.0",
                    "--diffusion-kl-beta", "0.02"]


def test_flag_values_reads_multi_word_equals_and_switch_forms_later_wins():
    values = flag_values(["--targets", "a", "b", "--lr=0.1", "--colocate", "--lr", "0.2"])
    assert values == {"--targets": "a b", "--lr": "0.2", "--colocate": ""}


def test_locked_flags_record_the_recipe_values():
    locked = locked_flag_values("--diffusion-num-steps 8 --lr 1e-4", ["--diffusion-num-steps", "seed"])
    assert locked == {"--diffusion-num-steps": "8", "--seed": None}


@pytest.mark.parametrize("extra", ["--diffusion-num-steps 4", "--lr 1 --diffusion-num-steps=4"])
def test_overriding_a_locked_flag_names_flag_recipe_value_and_fix(extra):
    with pytest.raises(LockedFlagError) as err:
        check_locked_flags(extra, {"--diffusion-num-steps": "8"})
    message = str(err.value)
    assert "--diffusion-num-steps" in message and "'8'" in message and "edit the recipe" in message


def test_extra_args_that_leave_locked_flags_alone_pass():
    check_locked_flags("--lr 1e-3 --diffusion-num-steps-extra 2", {"--diffusion-num-steps": "8"})
