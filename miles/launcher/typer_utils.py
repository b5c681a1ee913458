"""`dataclass_cli`: a dataclass of script options becomes a Typer command.

Each field `num_rollout` is both the option `--num-rollout` and the environment variable
`MILES_SCRIPT_NUM_ROLLOUT`; the command line beats the environment, which beats the field
default. Values from both sources go through one converter, so a bad value names the option and
its variable whichever way it came in.

Three shapes:

    @dataclass_cli
    def main(args: ScriptArgs): ...
    main()                                   # parses sys.argv, exits like any CLI

    app = dataclass_cli_app(prepare_data, train, full_train)   # subcommands, `_` -> `-`
    app()

    app = typer.Typer(); app.command()(dataclass_cli(train))   # plain Typer, if you prefer
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import os
import sys
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import typer

from miles.records import phases
from miles.utils.numerics import pin_this_process

ENV_PREFIX = "MILES_SCRIPT_"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off", "n"})
_REQUIRED = object()


@dataclass(frozen=True)
class OptionSpec:
    """How one dataclass field appears on the command line and in the environment."""

    field_name: str
    option: str
    env_var: str
    annotation: Any
    help: str

    @property
    def is_bool(self) -> bool:
        return _strip_optional(self.annotation) is bool


class OptionValueError(ValueError):
    """A value that cannot be converted to its field's type."""


def option_specs(cls: type, env_prefix: str = ENV_PREFIX) -> list[OptionSpec]:
    hints = typing.get_type_hints(cls)
    return [
        OptionSpec(
            field_name=f.name,
            option="--" + f.name.replace("_", "-"),
            env_var=env_prefix + f.name.upper(),
            annotation=hints[f.name],
            help=f.metadata.get("help", ""),
        )
        for f in dataclasses.fields(cls)
        if f.init
    ]


def _strip_optional(annotation: Any) -> Any:
    """`Optional[X]` / `X | None` -> X; anything else unchanged."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        non_none = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return annotation


def _allows_none(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        annotation
    )


def choices_of(annotation: Any) -> list[str] | None:
    base = _strip_optional(annotation)
    if typing.get_origin(base) is Literal:
        return [str(v) for v in typing.get_args(base)]
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return [str(m.value) for m in base]
    return None


_SCALARS = (str, int, float, bool, Path)


def _check_supported(spec: OptionSpec) -> None:
    base = _strip_optional(spec.annotation)
    if base in _SCALARS or choices_of(base) is not None:
        return
    raise TypeError(f"dataclass_cli: field {spec.field_name!r} has type {spec.annotation!r}; "
                    f"use str, int, float, bool, Path, a Literal or an Enum")


def convert_value(raw: str, annotation: Any) -> Any:
    """Turn the text of an option or variable into the field's type; raise OptionValueError."""
    base = _strip_optional(annotation)
    if _allows_none(annotation) and raw.strip().lower() in ("", "none"):
        return None
    if typing.get_origin(base) is Literal:
        return _convert_literal(raw, typing.get_args(base))
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return _convert_enum(raw, base)
    if base is bool:
        return _convert_bool(raw)
    if base in (int, float):
        try:
            return base(raw)
        except ValueError:
            raise OptionValueError(f"{raw!r} is not a valid {base.__name__}") from None
    if base in (str, Path):
        return base(raw)
    raise TypeError(f"dataclass_cli cannot parse fields of type {annotation!r}")


def _convert_literal(raw: str, allowed: tuple[Any, ...]) -> Any:
    for value in allowed:
        if str(value) == raw:
            return value
    raise OptionValueError(f"{raw!r} is not one of {', '.join(map(str, allowed))}")


def _convert_enum(raw: str, enum_cls: type[enum.Enum]) -> enum.Enum:
    for member in enum_cls:
        if str(member.value) == raw or member.name == raw:
            return member
    raise OptionValueError(f"{raw!r} is not one of {', '.join(str(m.value) for m in enum_cls)}")


def parse_bool_word(raw: str, true_words: Collection[str] = _TRUE_WORDS,
                    false_words: Collection[str] = _FALSE_WORDS) -> bool | None:
    """True for a word of `true_words`, False for one of `false_words` (any case, outer spaces
    ignored); None for anything else, which the caller refuses in its own words."""
    word = raw.strip().lower()
    return True if word in true_words else False if word in false_words else None


def _convert_bool(raw: str) -> bool:
    value = parse_bool_word(raw)
    if value is None:
        raise OptionValueError(f"{raw!r} is not a boolean (use 1/0, true/false, yes/no)")
    return value


def resolve_options(
    cls: type,
    cli_values: dict[str, Any],
    environ: typing.Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> Any:
    """Build `cls` from command-line values (None = not given), then the environment, then defaults.

    Raises typer.BadParameter (exit status 2) naming the option and its variable.
    """
    environ = os.environ if environ is None else environ
    kwargs: dict[str, Any] = {}
    for spec in option_specs(cls, env_prefix):
        given = cli_values.get(spec.field_name)
        if given is not None:
            kwargs[spec.field_name] = _convert_or_fail(given, spec, source=spec.option)
        elif spec.env_var in environ:
            kwargs[spec.field_name] = _convert_or_fail(environ[spec.env_var], spec, source=spec.env_var)
        elif _field_default(cls, spec.field_name) is _REQUIRED:
            raise typer.BadParameter(
                f"missing: give {spec.option} or set {spec.env_var}", param_hint=f"{spec.option} / {spec.env_var}"
            )
    return cls(**kwargs)


def _convert_or_fail(raw: Any, spec: OptionSpec, source: str) -> Any:
    if isinstance(raw, bool):  # a --x/--no-x flag: already a bool
        return raw
    try:
        return convert_value(str(raw), spec.annotation)
    except OptionValueError as err:
        raise typer.BadParameter(
            f"{err} (from {source})",
            param_hint=f"{spec.option} / {spec.env_var}",
        ) from None


def print_options_table(args: Any, title: str | None = None, env_prefix: str = ENV_PREFIX) -> None:
    """Print the resolved options as a table, so a log records what the script ran with.

    A field's `metadata["display"]` (value -> str) replaces the plain rendering, e.g. to redact.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or f"{type(args).__name__} (resolved options)", title_justify="left")
    table.add_column("option")
    table.add_column("value", overflow="fold")
    table.add_column("environment variable", style="dim")
    shown_as = {f.name: f.metadata.get("display", _display) for f in dataclasses.fields(args)}
    for spec in option_specs(type(args), env_prefix):
        table.add_row(spec.option, shown_as[spec.field_name](getattr(args, spec.field_name)), spec.env_var)
    Console(soft_wrap=False, width=max(120, _terminal_width())).print(table)


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 120


def _display(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    return repr(value) if value == "" else str(value)


def dataclass_cli(func: Callable | None = None, env_var_prefix: str | None = None, *, env_prefix: str = ENV_PREFIX,
                  print_table: bool = True):
    """Turn `func(args: SomeDataclass)` into a Typer-ready command.

    The returned function can be called three ways: with no arguments (parses sys.argv and
    exits, like `typer.run`), with a dataclass instance (runs `func` directly, for tests and for
    one command calling another), or by Typer with keyword options (after `app.command()`, or
    `typer.run(main)`). `env_var_prefix` is miles-diffusion's name for `env_prefix`.
    """
    if env_var_prefix is not None:
        env_prefix = env_var_prefix
    if func is None:
        return functools.partial(dataclass_cli, env_prefix=env_prefix, print_table=print_table)
    cls = _dataclass_parameter(func)
    specs = option_specs(cls, env_prefix)
    if not specs:  # Typer would call us with no keywords, which means "parse sys.argv" here
        raise TypeError(f"dataclass_cli needs a dataclass with at least one field, got {cls.__name__}")
    for spec in specs:
        _check_supported(spec)

    @functools.wraps(func)
    def command(*positional: Any, **cli_values: Any) -> Any:
        if positional and isinstance(positional[0], cls):
            return func(*positional)
        if not positional and not cli_values:
            return dataclass_cli_app(command, help=_script_help(func))()
        args = resolve_options(cls, cli_values, env_prefix=env_prefix)
        # a recipe builds checkpoints in this process (prepare()): pinned before torch loads
        pin_this_process()
        phases.mark("recipe_process_start", t=phases.process_started_at())
        phases.mark("recipe_start")
        if print_table:
            print_options_table(args, env_prefix=env_prefix)
        return func(args)

    del command.__wrapped__  # Typer must read our signature, not func's
    command.__signature__ = inspect.Signature(
        [_typer_parameter(spec, cls) for spec in specs]
    )
    command.__annotations__ = {p.name: p.annotation for p in command.__signature__.parameters.values()}
    command.dataclass_type = cls
    return command


def _script_help(func: Callable) -> str | None:
    """The function's docstring, else its module's (a recipe's docstring says what it trains)."""
    module = sys.modules.get(func.__module__)
    return inspect.getdoc(func) or (inspect.getdoc(module) if module else None)


def dataclass_cli_app(*funcs: Callable, help: str | None = None, name: str | None = None) -> typer.Typer:
    """One Typer app whose commands are `funcs` (each decorated with dataclass_cli if not yet).

    A single function becomes the app itself (no subcommand name); several become subcommands
    named after the functions with `_` turned into `-` (`full_train` -> `full-train`).
    """
    app = typer.Typer(help=verbatim_help(help), name=name, add_completion=False, rich_markup_mode=None,
                      pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})
    for func in funcs:
        command = func if hasattr(func, "dataclass_type") else dataclass_cli(func)
        # a single command is the whole app, and Typer shows the command's help, not the app's
        command_help = inspect.getdoc(func) or (help if len(funcs) == 1 else None)
        app.command(name=func.__name__.replace("_", "-"), help=verbatim_help(command_help))(command)
    return app


def _dataclass_parameter(func: Callable) -> type:
    hints = typing.get_type_hints(func)
    params = list(inspect.signature(func).parameters)
    if len(params) != 1 or params[0] not in hints or not dataclasses.is_dataclass(hints[params[0]]):
        raise TypeError(f"dataclass_cli needs a function of one dataclass-annotated argument, got {func!r}")
    return hints[params[0]]


def _typer_parameter(spec: OptionSpec, cls: type) -> inspect.Parameter:
    choices = choices_of(spec.annotation)
    default_text = _default_text(cls, spec.field_name)
    # parentheses, not brackets: under typer.run's rich markup a [..] would be read as a tag and vanish
    help_text = f"{spec.help} ({default_text}; env {spec.env_var})".strip()
    if spec.is_bool:
        option = typer.Option(None, f"{spec.option}/--no-{spec.option[2:]}", help=help_text, show_default=False)
        annotation = Optional[bool]
    else:
        metavar = "|".join(choices) if choices else _metavar(spec.annotation)
        option = typer.Option(None, spec.option, help=help_text, show_default=False, metavar=metavar)
        annotation = Optional[str]
    return inspect.Parameter(spec.field_name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _default_text(cls: type, name: str) -> str:
    """`metadata["default_help"]` describes a computed default better than today's value of it."""
    described = next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("default_help")
    if described:
        return f"default: {described}"
    default = _field_default(cls, name)
    return "required" if default is _REQUIRED else f"default: {_display(default)}"


def verbatim_help(text: str | None) -> str | None:
    """Keep a docstring's own line breaks in --help (Click rewraps paragraphs not marked with \b)."""
    if not text:
        return text
    return "\n\n".join(f"\b\n{paragraph}" for paragraph in text.split("\n\n"))


def _metavar(annotation: Any) -> str:
    base = _strip_optional(annotation)
    return {int: "INT", float: "FLOAT", Path: "PATH"}.get(base, "TEXT")


def _field_default(cls: type, name: str) -> Any:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _REQUIRED
