import enum
import sys
import types
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest
from typer.testing import CliRunner

from miles.launcher.typer_utils import (
    convert_value, dataclass_cli, dataclass_cli_app, parse_bool_word, resolve_options,
)


class Scale(enum.Enum):
    FULL = "full"
    CPU_PROXY = "cpu-proxy"


@dataclass
class Args:
    num_rollout: int = field(default=3, metadata={"help": "Rollouts to train."})
    lr: float = 1e-4
    use_ema: bool = False
    scale: Scale = Scale.FULL
    family: Literal["sd3", "wan2_2"] = "sd3"
    note: Optional[str] = None


@dataclass
class NeedsHost:
    head_address: str = field(metadata={"help": "host:port of the head."})


def _run(command, argv, env=None):
    seen = []

    @dataclass_cli
    def main(args: Args):
        seen.append(args)

    result = CliRunner().invoke(dataclass_cli_app(command or main), argv, env=env or {})
    return result, seen


def test_command_line_beats_environment_beats_default():
    default, seen_default = _run(None, [])
    from_env, seen_env = _run(None, [], env={"MILES_SCRIPT_NUM_ROLLOUT": "7"})
    from_cli, seen_cli = _run(None, ["--num-rollout", "9"], env={"MILES_SCRIPT_NUM_ROLLOUT": "7"})
    assert (default.exit_code, from_env.exit_code, from_cli.exit_code) == (0, 0, 0)
    assert [s[0].num_rollout for s in (seen_default, seen_env, seen_cli)] == [3, 7, 9]


def test_bool_fields_are_flag_pairs_and_read_env_words():
    _, on = _run(None, ["--use-ema"])
    _, off = _run(None, ["--no-use-ema"], env={"MILES_SCRIPT_USE_EMA": "yes"})
    _, env_on = _run(None, [], env={"MILES_SCRIPT_USE_EMA": "true"})
    assert (on[0].use_ema, off[0].use_ema, env_on[0].use_ema) == (True, False, True)


def test_a_bool_word_is_read_in_any_case_from_the_callers_words_and_anything_else_is_none():
    assert [parse_bool_word(w) for w in (" YES ", "n", "Off", "maybe")] == [True, False, False, None]
    assert parse_bool_word("y", true_words=("1", "on"), false_words=("0", "off")) is None


def test_enum_and_literal_fields_accept_their_choices():
    _, seen = _run(None, ["--scale", "cpu-proxy", "--family", "wan2_2"])
    assert seen[0].scale is Scale.CPU_PROXY and seen[0].family == "wan2_2"


@pytest.mark.parametrize(
    "argv, env, source",
    [
        (["--num-rollout", "many"], {}, "--num-rollout"),
        ([], {"MILES_SCRIPT_NUM_ROLLOUT": "many"}, "MILES_SCRIPT_NUM_ROLLOUT"),
        (["--scale", "huge"], {}, "--scale"),
        ([], {"MILES_SCRIPT_USE_EMA": "maybe"}, "MILES_SCRIPT_USE_EMA"),
    ],
)
def test_bad_value_from_either_source_exits_2_naming_option_and_variable(argv, env, source):
    result, seen = _run(None, argv, env=env)
    assert result.exit_code == 2 and not seen
    name = source if source.startswith("--") else "--" + source.removeprefix("MILES_SCRIPT_").lower().replace("_", "-")
    assert name in result.output
    assert "MILES_SCRIPT_" + name[2:].upper().replace("-", "_") in result.output


def test_help_lists_each_option_with_its_help_default_and_variable():
    result, _ = _run(None, ["--help"])
    assert result.exit_code == 0
    for text in ("--num-rollout", "Rollouts to train.", "default: 3", "MILES_SCRIPT_NUM_ROLLOUT",
                 "--use-ema / --no-use-ema", "full|cpu-proxy", "sd3|wan2_2"):
        assert text in result.output, text


def test_resolved_options_table_prints_before_the_function_runs():
    @dataclass_cli
    def main(args: Args):
        print("FUNCTION RUNS")

    result = CliRunner().invoke(dataclass_cli_app(main), ["--num-rollout", "5"])
    table_at, body_at = result.output.find("--num-rollout"), result.output.find("FUNCTION RUNS")
    assert 0 <= table_at < body_at


def test_app_of_several_functions_names_subcommands_with_dashes():
    calls = []

    def prepare_data(args: Args):
        calls.append(("prepare-data", args.num_rollout))

    def full_train(args: Args):
        calls.append(("full-train", args.num_rollout))

    app = dataclass_cli_app(prepare_data, full_train)
    assert CliRunner().invoke(app, ["full-train", "--num-rollout", "4"]).exit_code == 0
    assert CliRunner().invoke(app, ["prepare-data"]).exit_code == 0
    assert calls == [("full-train", 4), ("prepare-data", 3)]


def test_decorated_function_called_with_an_instance_skips_the_cli():
    @dataclass_cli
    def main(args: Args):
        return args.num_rollout * 2

    assert main(Args(num_rollout=21)) == 42


def test_required_field_missing_from_both_sources_exits_2():
    def worker(args: NeedsHost):
        pass

    result = CliRunner().invoke(dataclass_cli_app(worker), [], env={})
    assert result.exit_code == 2
    assert "--head-address" in result.output and "MILES_SCRIPT_HEAD_ADDRESS" in result.output


def test_optional_field_reads_none_and_empty_as_none():
    assert convert_value("none", Optional[int]) is None
    assert convert_value("", Optional[int]) is None
    assert convert_value("5", Optional[int]) == 5


def test_resolve_options_uses_the_given_environment_mapping():
    args = resolve_options(Args, {"lr": None}, environ={"MILES_SCRIPT_LR": "0.5"})
    assert args.lr == 0.5


def test_unsupported_field_type_is_rejected_at_decoration():
    @dataclass
    class Bad:
        items: list[int] = field(default_factory=list)

    def main(args: Bad):
        pass

    with pytest.raises(TypeError, match="items"):
        dataclass_cli(main)


def test_custom_env_prefix_is_read_and_shown_in_help():
    seen = []

    @dataclass_cli(env_prefix="MY_TOOL_")
    def main(args: Args):
        seen.append(args.num_rollout)

    app = dataclass_cli_app(main)
    result = CliRunner().invoke(app, [], env={"MY_TOOL_NUM_ROLLOUT": "11", "MILES_SCRIPT_NUM_ROLLOUT": "5"})
    assert result.exit_code == 0 and seen == [11]
    assert "MY_TOOL_NUM_ROLLOUT" in CliRunner().invoke(app, ["--help"]).output


def test_script_help_falls_back_to_the_module_docstring(monkeypatch, capsys):
    docstring = "Trains a tiny thing.\n\nExample:\n    python3 run_tiny.py --num-rollout 5\n"
    module = types.ModuleType("fake_recipe", docstring)
    monkeypatch.setitem(sys.modules, "fake_recipe", module)

    def main(args: Args):
        pass

    main.__module__ = "fake_recipe"
    command = dataclass_cli(main)
    monkeypatch.setattr(sys, "argv", ["run_tiny.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        command()
    assert exit_info.value.code == 0
    output = capsys.readouterr().out
    assert "Trains a tiny thing." in output and "python3 run_tiny.py --num-rollout 5" in output


def test_verbatim_help_keeps_indented_examples_on_their_own_lines():
    def main(args: Args):
        pass

    app = dataclass_cli_app(main, help="Trains a tiny thing.\n\nExample:\n    python3 run_tiny.py --num-rollout 5")
    output = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    assert "\n      python3 run_tiny.py --num-rollout 5\n" in output
