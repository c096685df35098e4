"""`RealtimeSession`: one Converse session as an async context manager with typed events.

    async with RealtimeSession("127.0.0.1:50051", instructions="Be brief.") as session:
        await session.send_audio(pcm16_bytes_or_numpy)
        await session.commit()
        await session.create_response()
        async for event in session.events():
            if isinstance(event, events.ResponseOutputAudioDeltaEvent): play(event.audio)
            elif isinstance(event, events.ResponseDoneEvent): break

Entering opens the stream and waits for `session.created` (a refusal raises `Refused`,
`Unauthenticated`, ...); keyword arguments are the session's configuration, sent as its first
`session.update` (docs/protocol.md#events). Leaving ends the session as the protocol says: a
`session.close`, the half-close, then the server's `session.closed` and the stream's end.
Writes are serialised here, so any task may send while another reads the events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import numpy as np
from rtmedia.clients import events
from rtmedia.clients.audio_file import pcm16
from rtmedia.clients.channels import DEFAULT_TARGET, aio_channel
from rtmedia.clients.credentials import Credentials
from rtmedia.clients.errors import RtmediaError
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2
from rtmedia.v1.realtime_pb2_grpc import RealtimeServiceStub

CLOSE_WAIT_S = 5.0  # how long leaving waits for the server's end of the stream before cancelling it


class RealtimeSession:
    """A duplex speech session over `Converse` (docs/protocol.md).

    `target` and `credentials` open a channel of the session's own (closed with it); pass
    `channel` to share one, e.g. across many sessions. `metadata` goes with the call (e.g.
    `rtmedia-transport`). After entering, `created` is the `session.created` event and `id`
    the session's id.
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, credentials: Credentials | None = None,
                 channel: grpc.aio.Channel | None = None, metadata: Sequence[tuple[str, str]] = (),
                 timeout: float | None = None, **config: Any) -> None:
        self._own_channel = channel is None
        self.channel = channel if channel is not None else aio_channel(target, credentials)
        self.metadata, self.timeout, self.config = tuple(metadata), timeout, config
        self.call: Any = None
        self.created: events.SessionCreatedEvent | None = None
        self.closed: events.SessionClosedEvent | None = None  # the server's session.closed, once it came
        self._lock = asyncio.Lock()
        self._half_closed = False
        self._reading = False

    @property
    def id(self) -> str:
        return self.created.session_id if self.created is not None else ""

    async def __aenter__(self) -> RealtimeSession:
        try:
            await self.open()
        except BaseException:
            await self._close_channel()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> events.SessionCreatedEvent:
        """Start the session: wait for `session.created`, then send the configuration (if any)."""
        self.call = RealtimeServiceStub(self.channel).Converse(metadata=self.metadata or None, timeout=self.timeout)
        first = await self._read()
        if not isinstance(first, events.SessionCreatedEvent):
            self.call.cancel()
            raise RtmediaError(grpc.StatusCode.UNKNOWN, f"the session began with {first.type or 'nothing'}, "
                                                        "not session.created")
        self.created = first
        if self.config:
            await self.update(**self.config)
        return first

    # ---- client events ----------------------------------------------------------------------------
    async def send(self, request: realtime_pb2.ConverseRequest) -> None:
        """Send any client event (a ConverseRequest, e.g. from `client_event(...)`)."""
        async with self._lock:
            if self._half_closed:
                raise RtmediaError(grpc.StatusCode.FAILED_PRECONDITION, "the session is closing: nothing more "
                                                                        "can be sent", "SESSION_CLOSING")
            try:
                await self.call.write(request)
            except grpc.aio.AioRpcError as exc:
                raise RtmediaError.from_rpc(exc) from None
            except asyncio.InvalidStateError:  # the call has ended: the reader says how
                raise RtmediaError(grpc.StatusCode.FAILED_PRECONDITION, "the session's stream has ended",
                                   "SESSION_CLOSED") from None

    async def event(self, name: str, /, event_id: str = "", **fields: Any) -> None:
        """Send client event `name` with `fields` (Python values, as `client_event` takes them)."""
        await self.send(client_event(name, event_id, **fields))

    async def update(self, **config: Any) -> None:
        """`session.update` with these fields of SessionConfig; `session.updated` (or an error) follows."""
        await self.event("session.update", session=config)

    async def send_audio(self, audio: bytes | np.ndarray) -> None:
        """Append user audio (PCM16 bytes, int16 or float samples) at the session's input rate."""
        await self.event("input_audio_buffer.append", audio=pcm16(audio))

    async def commit(self) -> None:
        """End the user's turn by hand (`input_audio_buffer.commit`, for manual turn detection)."""
        await self.event("input_audio_buffer.commit")

    async def clear_audio(self) -> None:
        """Discard uncommitted user audio (`input_audio_buffer.clear`)."""
        await self.event("input_audio_buffer.clear")

    async def create_response(self, **overrides: Any) -> None:
        """Ask for a reply (`response.create`); overrides: instructions, max_output_tokens, ..."""
        await self.event("response.create", **overrides)

    async def cancel(self, response_id: str = "") -> None:
        """Stop a reply (the current one when `response_id` is empty)."""
        await self.event("response.cancel", response_id=response_id)

    async def truncate(self, item_id: str, audio_end_ms: int, content_index: int = 0) -> None:
        """Cut an assistant item's audio at what the user heard (`conversation.item.truncate`)."""
        await self.event("conversation.item.truncate", item_id=item_id, content_index=content_index,
                         audio_end_ms=audio_end_ms)

    async def ack_playback(self, response_id: str, played_ms: int) -> None:
        """Say how much of a reply has been played (`playback.ack`): barge-in truncates there."""
        await self.event("playback.ack", response_id=response_id, played_ms=played_ms)

    async def add_item(self, item: dict[str, Any] | realtime_pb2.ConversationItem) -> None:
        """Add a conversation item (`conversation.item.create`), e.g. a function call's output."""
        await self.event("conversation.item.create", item=item)

    # ---- server events ----------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[events.ServerEvent]:
        """The session's server events, typed, until the stream ends (after `session.closed`).

        A failed stream raises its `RtmediaError`; one this session cancelled just ends."""
        self._reading = True
        try:
            while (event := await self._read()) is not None:
                yield event
        finally:
            self._reading = False

    async def next_event(self) -> events.ServerEvent | None:
        """The next server event, or None once the stream has ended (`events()` one at a time)."""
        return await self._read()

    async def _read(self) -> Any:
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self.call.cancelled():
                return None
            raise RtmediaError.from_rpc(exc) from None
        except asyncio.CancelledError:
            if self.call is not None and self.call.cancelled() and not _current_cancelling():
                return None
            raise
        if msg is grpc.aio.EOF:
            return None
        event = events.wrap(msg)
        if isinstance(event, events.SessionClosedEvent):
            self.closed = event
            await self._half_close()  # nothing more is sent: the stream ends at once
        return event

    # ---- the end ----------------------------------------------------------------------------------
    async def close(self, reason: str = "client") -> None:
        """End the session (`session.close`, then the half-close) and wait for the stream's end."""
        if self.call is None:
            await self._close_channel()
            return
        try:
            if self.closed is None and not self.call.done():
                with contextlib.suppress(RtmediaError):
                    await self.event("session.close", reason=reason)
            await self._half_close()
            if not self._reading:  # nobody else reads: drain to session.closed and the end
                with contextlib.suppress(RtmediaError, asyncio.TimeoutError):
                    async with asyncio.timeout(CLOSE_WAIT_S):
                        while await self._read() is not None:
                            pass
            with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError):
                await asyncio.wait_for(self.call.code(), CLOSE_WAIT_S)
        finally:
            if not self.call.done():
                self.call.cancel()
            await self._close_channel()

    def cancel_stream(self) -> None:
        """Cancel the call at once (no session.close): the server frees the session's resources."""
        if self.call is not None and not self.call.done():
            self.call.cancel()

    async def end_input(self) -> None:
        """Half-close: nothing more is sent (after a `session.close`, the server's end follows)."""
        await self._half_close()

    async def _half_close(self) -> None:
        async with self._lock:
            if self._half_closed:
                return
            self._half_closed = True
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await self.call.done_writing()

    async def _close_channel(self) -> None:
        if self._own_channel:
            await self.channel.close()


def _current_cancelling() -> int:
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0
