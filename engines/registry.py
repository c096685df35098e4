"""Named choices of one kind of engine: which backend a setting's name builds.

Each kind keeps one `Registry` (engines/asr/registry.py: the recognisers; engines/asr/whisper_runtimes.py:
Whisper's runtimes; ...). An entry is a name and a factory; the factory imports its backend only when it is
called, so naming a backend never loads another's dependencies. The registry is the one place that maps a
setting's name to code: the server asks it for the names (config validation, a flag's choices) and for the
backend of a name, and never compares names itself. Adding a backend is its module plus one `add`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Factories of one kind by name, in the order they were added (the first is listed first)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # what the names choose, for messages ("recogniser", "Whisper runtime")
        self._entries: dict[str, Callable[..., T]] = {}

    def add(self, name: str, factory: Callable[..., T], replace: bool = False) -> Callable[..., T]:
        """Register `factory` under `name`; ValueError when the name is taken (unless `replace`)."""
        if not name or name != name.strip():
            raise ValueError(f"{self.kind} name {name!r}: expected a non-empty name without spaces around it")
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name] = factory
        return factory

    def remove(self, name: str) -> None:
        """Forget `name` (a test's entry); nothing when it is not there."""
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def factory(self, name: str) -> Callable[..., T]:
        """The factory of `name`; ValueError lists the names there are."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"{self.kind} {name!r}: expected one of {', '.join(self._entries)}") from None

    def build(self, name: str, *args: object, **kwargs: object) -> T:
        """What the factory of `name` makes of the arguments."""
        return self.factory(name)(*args, **kwargs)
