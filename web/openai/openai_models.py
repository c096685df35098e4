"""What the OpenAI-compatible front (rtmedia.web.openai.openai_api) names: the prefix of its
paths, the model names each endpoint accepts (rtmedia's own, and OpenAI's, which map onto the
same engines), the check of a request's `model`, and a model's entry in `GET /v1/models`.

Apart from the front so that its handlers (speech, transcriptions) check their models without
importing the front that mounts them.
"""

from __future__ import annotations

from typing import Any

from rtmedia.web.openai.openai_errors import OpenAIError
from rtmedia.web.openai.realtime_config import REALTIME_MODELS, unknown_model

PREFIX = "/v1/"
OWNER = "rtmedia"
# Model names each endpoint accepts: rtmedia's own, and OpenAI's, which map onto the same engines.
SPEECH_MODELS = ("rtmedia-piper", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
TRANSCRIPTION_MODELS = ("rtmedia-asr", "whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
MODELS = (*SPEECH_MODELS, *TRANSCRIPTION_MODELS, *REALTIME_MODELS)


def is_openai_path(path: str) -> bool:
    return path.startswith(PREFIX)


def check_model(model: Any, known: tuple[str, ...]) -> str:
    """The request's `model`: a string the endpoint accepts, else a 400 or 404 naming it."""
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model is required: a string, one of " + ", ".join(known), param="model",
                          code="missing_model" if model in (None, "") else "invalid_type")
    if model not in known:
        raise OpenAIError(404, unknown_model(model, known), param="model", code="model_not_found")
    return model


def model_entry(name: str) -> dict[str, Any]:
    """A model as `GET /v1/models` lists it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": OWNER}
