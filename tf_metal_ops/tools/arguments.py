"""argparse value types shared by the command-line tools (standard library only)."""

from __future__ import annotations

import argparse


def whole_number(text: str, minimum: int, maximum: "int | None" = None) -> int:
    """Parses `text` as an int in [minimum, maximum); argparse reports the error with usage."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum})"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number {bounds}, got {text!r}") from None
    if value < minimum or (maximum is not None and value >= maximum):
        raise argparse.ArgumentTypeError(f"expected a whole number {bounds}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)
