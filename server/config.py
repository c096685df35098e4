"""Server configuration: defaults, a YAML deploy file, then command-line flags.

`ServerConfig` is a dataclass of typed sections (server/config_sections.py), each declared once
with rtmedia.protocol.settings: the `serve` flags, the deploy file's keys and their checks all
come from those declarations. The deploy file's keys are flat (`asr_threads: 2`, as
docs/operations.md lists them) or nested by section (`asr: {threads: 2}`); `ServerConfig.of`
builds one from flat keys. The web front's sections join these in `rtmedia serve`'s own
configuration (server/cli.py ServeConfig), since the server imports no door.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from rtmedia.protocol.settings import flat_index, root_from_flat
from rtmedia.server.config_sections import (
    ASR_BACKENDS,
    ASR_ENGINES,
    STEP_DEADLINES_S,
    AsrSettings,
    AuthSettings,
    ComputeSettings,
    LanesSettings,
    LimitsSettings,
    LmSettings,
    LoggingSettings,
    MiB,
    NetworkSettings,
    OpenAiSettings,
    RecordingSettings,
    TracingSettings,
    TtsSettings,
    TurnSettings,
    VadSettings,
    VideoSettings,
)

__all__ = ["ASR_BACKENDS", "ASR_ENGINES", "STEP_DEADLINES_S", "AsrSettings", "MiB", "ServerConfig", "read_deploy_file"]

C = TypeVar("C", bound="ServerConfig")


def read_deploy_file(path: str | Path) -> dict[str, Any]:
    """The settings of a YAML deploy file: its `server:` mapping (or the top level without one)."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings at the top level")
    settings = data.get("server", data)
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: expected a mapping of settings under server:")
    return dict(settings)


@dataclass
class ServerConfig:
    """The server's settings by section; each section checks its own fields on construction."""

    network: NetworkSettings = field(default_factory=NetworkSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    asr: AsrSettings = field(default_factory=AsrSettings)
    vad: VadSettings = field(default_factory=VadSettings)
    turn: TurnSettings = field(default_factory=TurnSettings)
    tts: TtsSettings = field(default_factory=TtsSettings)
    lm: LmSettings = field(default_factory=LmSettings)
    openai: OpenAiSettings = field(default_factory=OpenAiSettings)
    compute: ComputeSettings = field(default_factory=ComputeSettings)
    video: VideoSettings = field(default_factory=VideoSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    lanes: LanesSettings = field(default_factory=LanesSettings)
    recording: RecordingSettings = field(default_factory=RecordingSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)

    def step_deadline(self, lane: str) -> float | None:
        """The step deadline of `lane` in seconds, or None for no deadline."""
        return self.lanes.step_deadline(lane)

    @classmethod
    def of(cls: type[C], **flat: Any) -> C:
        """A configuration from flat keys (the deploy file's: `asr_threads=2`) or nested section
        mappings; what is not given keeps its default; an unknown key fails naming it."""
        return root_from_flat(cls, cls.legacy(flat))

    @classmethod
    def legacy(cls, values: dict[str, Any]) -> dict[str, Any]:
        """Old spellings of keys rewritten to today's (none of the server's own)."""
        return values

    @classmethod
    def keys(cls) -> list[str]:
        """Every flat key, in declaration order."""
        return list(flat_index(cls))

    def flat(self) -> dict[str, Any]:
        """Every setting as its flat key."""
        out: dict[str, Any] = {}
        for attr in vars(self):
            section = getattr(self, attr)
            if hasattr(section, "flat"):
                out.update(section.flat())
        return out

    @classmethod
    def load(cls: type[C], path: str | Path | None = None, **overrides: object) -> C:
        """Defaults, then the YAML file's keys, then the overrides that are not None."""
        values: dict[str, Any] = read_deploy_file(path) if path else {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.of(**values)
