"""The value types of train_diffusion.py's flags: each accepts the string argparse hands over and the
typed value a YAML config gives, and refuses anything else with argparse's one line. The parser
(arguments) and the public and upstream names (public_flags, upstream_values, capability_flags) share
them. Torch-free.
"""

from __future__ import annotations

import argparse
from typing import Any

_DTYPE_WORDS = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32",
                "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {value!r}") from None
    if kind is int and isinstance(value, float) and value != number:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}")
    return number


def positive_int(value: Any) -> int:
    number = _number(value, int)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return number


def non_negative_int(value: Any) -> int:
    number = _number(value, int)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return number


def any_int(value: Any) -> int:
    return _number(value, int)


def any_float(value: Any) -> float:
    return _number(value, float)


def positive_float(value: Any) -> float:
    number = _number(value, float)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    return number


def non_negative_float(value: Any) -> float:
    number = _number(value, float)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return number


def unit_interval(value: Any) -> float:
    """A value in [0, 1): Adam betas, EMA decay."""
    number = _number(value, float)
    if not 0.0 <= number < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value!r}")
    return number


def fraction(value: Any) -> float:
    """A value in (0, 1]: a fraction of the denoising steps."""
    number = _number(value, float)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value!r}")
    return number


def dtype_word(word: str) -> str:
    if word not in _DTYPE_WORDS:
        raise argparse.ArgumentTypeError(f"invalid choice {word!r} (choose from fp16, bf16, fp32)")
    return _DTYPE_WORDS[word]
