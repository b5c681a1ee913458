"""argparse value types that refuse a bad value in one line naming it (argparse adds the flag)."""

from __future__ import annotations

import argparse
from typing import Callable


def at_least(least: int, multiple: int = 1, why: str = "") -> Callable[[str], int]:
    """An int >= `least` (and a multiple of `multiple`, for the reason `why`), else one line."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
        if number < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {number}")
        if number % multiple:
            raise argparse.ArgumentTypeError(f"must be a multiple of {multiple}{f' ({why})' if why else ''}, "
                                             f"got {number}; fix: use {max(multiple, number - number % multiple)}")
        return number
    return parse
