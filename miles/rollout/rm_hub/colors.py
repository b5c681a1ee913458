"""Colour names the cheap rewards understand and the tiny prompt set uses.

Kept apart from both so that the prompts a recipe writes and the reward that scores them name
exactly the same colours.
"""

from __future__ import annotations

import re

# RGB in [0, 1]. Saturated, well-separated colours so that a mean colour is a clear target.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 0.8, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "orange": (1.0, 0.5, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "pink": (1.0, 0.6, 0.8),
    "cyan": (0.0, 1.0, 1.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
}

_WORD = re.compile(r"[a-z]+")


def find_color(text: str) -> str | None:
    """The first colour name that occurs as a word in `text` (case-insensitive), or None."""
    for word in _WORD.findall(text.lower()):
        if word == "grey":
            return "gray"
        if word in COLORS:
            return word
    return None
