"""Subtitle files of a transcript, as OpenAI's transcription API answers `response_format` srt
and vtt: one cue per utterance, numbered from 1 in SRT, after the `WEBVTT` header in WebVTT.
Cue text is the utterance's text on one line (a blank line would end the cue), with any `-->`
(the timing line's arrow) made `->`: SRT has no escapes, and WebVTT forbids it in a cue."""

from __future__ import annotations

from collections.abc import Iterable

Cue = tuple[float, float, str]  # start and end in seconds, text


def timestamp(seconds: float, separator: str) -> str:
    """HH:MM:SS followed by `separator` and milliseconds (SRT: ",", WebVTT: ".")."""
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def srt(cues: Iterable[Cue]) -> str:
    blocks = [f"{n}\n{timestamp(start, ',')} --> {timestamp(end, ',')}\n{_line(text)}\n"
              for n, (start, end, text) in enumerate(cues, 1)]
    return "\n".join(blocks)


def vtt(cues: Iterable[Cue]) -> str:
    blocks = [f"{timestamp(start, '.')} --> {timestamp(end, '.')}\n{_line(text)}\n" for start, end, text in cues]
    return "\n".join(["WEBVTT\n", *blocks])


def _line(text: str) -> str:
    return " ".join(text.split()).replace("-->", "->")
