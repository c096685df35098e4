"""`rtmedia serve --sip`: the SIP door as a child process of the server (PJSIP's media clock
and callbacks never share the server's event loop), dialling the server's private socket.
Its log lines go on to the server's stderr; it drains and stops with the server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import sys
from typing import Any

from rtmedia.web.settings import SipSettings

log = logging.getLogger("rtmedia.sip")
READY = re.compile(rb"rtmedia sip: SIP on .* calls API (\S+)")
START_TIMEOUT_S = 60.0


class SipProcess:
    def __init__(self, settings: SipSettings) -> None:
        self.settings = settings  # (handed to the process as JSON: `rtmedia sip --sip-settings`)
        self.process: asyncio.subprocess.Process | None = None
        self.control: str | None = None  # the calls API's URL (None: --sip-control off)
        self._relay: asyncio.Task[None] | None = None

    async def start(self, target: str, log_format: str) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rtmedia.server.cli", "sip", "--target", target, "--log-format", log_format,
            "--sip-settings", self.settings.to_json(), stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        assert self.process.stderr is not None
        lines: list[bytes] = []
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while line := await self.process.stderr.readline():
                    sys.stderr.buffer.write(line)
                    lines.append(line)
                    if ready := READY.search(line):
                        self.control = None if ready.group(1) == b"off" else ready.group(1).decode()
                        break
        except TimeoutError:
            pass
        if self.control is None and not any(READY.search(line) for line in lines):
            await self.stop()
            last = next((ln.decode(errors="replace").strip() for ln in reversed(lines) if ln.strip()), "no output")
            raise OSError(f"the SIP door did not start: {last}")
        sys.stderr.flush()
        self._relay = asyncio.create_task(self._relay_output(), name="sip-output")

    async def _relay_output(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        while line := await self.process.stderr.readline():
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
        if (code := await self.process.wait()) not in (0, -signal.SIGTERM, -signal.SIGINT):
            log.error("the SIP door exited", extra={"returncode": code})

    def reload(self, tokens: Any = None) -> None:
        """(Nothing to reload: the door dials the server's private socket, without tokens.)"""

    async def drain(self, grace_s: float) -> None:
        """Its calls go on for at most `grace_s` while new ones get 503."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), grace_s + 10)

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._relay is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._relay, 2)
