"""What the client commands share (rtmedia.clients.commands.cli and the commands beside it:
talk, decode-video, loadtest): `CliError`, the error a command reports as one line and a
non-zero exit, the argparse number types that refuse a bad value in one line, and the help
text of an audio input.

A module of its own so that each command's module imports it, not the CLI that loads them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

AUDIO_IN_HELP = ("any audio file (wav, mp3, m4a/aac, ogg/opus, flac, webm, ...; any rate, any channels: "
                 "downmixed and resampled), or - for standard input")
RATE_HELP = "IN is raw PCM16 mono at this rate in Hz (e.g. `rtmedia synth ... -o -` piped in)"


class CliError(Exception):
    """An error the CLI reports as one line and a non-zero exit."""


def _number(kind: Callable[[str], Any], what: str, low: float, strict: bool) -> Callable[[str], Any]:
    """An argparse type: `kind` of the text, refused (one argparse error line) below `low`."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (strict and value == low) or value != value:  # NaN too
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = _number(int, "a positive integer", 0, strict=True)
non_negative_int = _number(int, "an integer of 0 or more", 0, strict=False)
positive_float = _number(float, "a positive number", 0, strict=True)
