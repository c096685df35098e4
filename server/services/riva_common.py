"""What the Riva speech servicers share: rejecting options with a status that names them."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from rtmedia.protocol.errors import abort, shown

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
LANGUAGES = ("en-US",)  # the voices' (synthesis); recognition checks the recogniser's (riva_asr.py)


class Rejected(Exception):
    """A request option rtmedia does not serve: the status code, an ErrorInfo reason, and a
    message that names the option."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


async def abort_rejected(context: grpc.aio.ServicerContext, exc: Rejected) -> None:
    await abort(context, exc.code, exc.reason, exc.message)


def check_language(language_code: str, field: str = "language_code") -> None:
    """A synthesis request's language: empty means en-US; anything else but en-US (any case) is
    rejected."""
    if language_code and language_code.lower() not in (code.lower() for code in LANGUAGES):
        raise Rejected(INVALID, "UNSUPPORTED_LANGUAGE",
                       f"{field}={shown(language_code)} is not served; languages: {', '.join(LANGUAGES)}")


def listed(names: list[str], most: int = 8, chars: int = 64) -> str:
    """Client-chosen names (option keys) for a message: the first `most`, each cut after `chars`."""
    shown_ = [name if len(name) <= chars else f"{name[:chars]}..." for name in names[:most]]
    return ", ".join(shown_) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def check_custom_configuration(custom: Mapping[str, str]) -> None:
    """rtmedia's models take no custom configuration keys."""
    if custom:
        keys = listed(sorted(custom))
        raise Rejected(INVALID, "UNSUPPORTED_OPTION",
                       f"custom_configuration keys are not supported by rtmedia's models: {keys}")
