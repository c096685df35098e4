"""Clients that vanish mid-stream: each opens a Converse session, speaks a real sentence, asks
for a reply (which takes an LM slot or the echo responder, and a TTS stream) and is gone while
it speaks or is answered, in one of three ways: it cancels its call, it closes its own
connection, or the process it lives in is killed with SIGKILL (the kernel closes its sockets,
so the server sees no goodbye at all).

Run as a script (`python tests/reliability/vanishing.py TARGET N`) it is that process: it
opens N such sessions, prints `ready` once they are open, and waits to be killed.

Used by tests/reliability/connection_faults.py and tests/perf/bench_hostile.py.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path

import grpc
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SPOKEN = "The quick brown fox jumps over the lazy dog."
RATE = 16000
CHUNK_BYTES = 3200  # 100 ms of 16 kHz PCM16
READY_TIMEOUT_S = 60.0
# A channel of its own connection: without it, channels to one target in one process share
# a connection, and closing one would leave the connection open.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def speech_audio() -> bytes:
    """A spoken sentence (16 kHz PCM16): enough for the VAD to start a turn and the ASR to
    lend its stream a decoder."""
    from tests.support.speech import Speaker

    return Speaker().say(SPOKEN, RATE).tobytes()


def speaking_events(audio: bytes) -> list:
    """A speaking session's requests: its input format, the sentence in 100 ms appends, a
    typed item and a response.create."""
    return [client_event("session.update", session={"input_audio_format": {"sample_rate": RATE}}),
            *(client_event("input_audio_buffer.append", audio=audio[at:at + CHUNK_BYTES])
              for at in range(0, len(audio), CHUNK_BYTES)),
            client_event("conversation.item.create", item={"text": "Tell me a story."}),
            client_event("response.create")]


def speaking_requests(audio: bytes) -> asyncio.Queue:
    """A queue holding `speaking_events(audio)`; later requests may be put on it."""
    queue: asyncio.Queue = asyncio.Queue()
    for request in speaking_events(audio):
        queue.put_nowait(request)
    return queue


async def from_queue(queue: asyncio.Queue):
    """A request iterator that never ends by itself: the stream stays open until its call goes."""
    while True:
        yield await queue.get()


async def vanishing_client(stub, audio: bytes, n: int, vanish) -> None:
    """One session that speaks, asks for a reply and vanishes (`vanish(call)`) 0-1.6 s after
    session.created (by `n`): while it speaks or is answered."""
    call = stub.Converse(from_queue(speaking_requests(audio)))
    await anext(aiter(call))  # session.created
    await asyncio.sleep(0.4 * (n % 5))
    await vanish(call)


async def vanishing(target: str, audio: bytes, clients: int = 200) -> dict:
    """`clients` sessions, vanishing in three ways: a third cancel their call, a third close
    their own connection, a third are in a process killed with SIGKILL."""
    third = clients // 3
    killed = await asyncio.create_subprocess_exec(sys.executable, __file__, target, str(third),
                                                  stdout=asyncio.subprocess.PIPE)
    try:
        async with grpc.aio.insecure_channel(target) as shared:
            stub = realtime_pb2_grpc.RealtimeServiceStub(shared)

            async def cancel(call) -> None:
                call.cancel()

            async def own_connection(n: int) -> None:
                channel = grpc.aio.insecure_channel(target, options=OWN_CONNECTION)

                async def close(call) -> None:
                    await channel.close(grace=None)

                try:
                    await vanishing_client(realtime_pb2_grpc.RealtimeServiceStub(channel), audio, n, close)
                finally:
                    await channel.close(grace=None)

            assert killed.stdout is not None
            ready = killed.stdout.readline()
            outcomes = await asyncio.gather(*(vanishing_client(stub, audio, n, cancel) for n in range(third)),
                                            *(own_connection(n) for n in range(clients - 2 * third)), ready,
                                            return_exceptions=True)
    finally:
        if killed.returncode is None:
            killed.kill()
        await killed.wait()
    # grpc lets go of a closed channel's connection once its calls are collected (they sit in
    # reference cycles with their request tasks): collect them, so the connections close now,
    # as a vanished client's would, and are not counted as the server's.
    gc.collect()
    failed = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    if failed or outcomes[-1] != b"ready\n":
        raise RuntimeError(f"{len(failed)} vanishing clients failed before vanishing: {failed[:3]}; "
                           f"the killed process said {outcomes[-1]!r}")
    return {"clients": clients, "cancelled": third, "closed_channel": clients - 2 * third, "sigkilled": third}


async def vanish_child(target: str, clients: int) -> None:
    """The killed process: open the sessions, say so on stdout, wait to be killed."""
    audio = speech_audio()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = realtime_pb2_grpc.RealtimeServiceStub(channel)

        opened = 0
        all_open = asyncio.Event()
        if not clients:
            all_open.set()

        async def never(call) -> None:
            nonlocal opened
            opened += 1
            if opened == clients:
                all_open.set()
            await asyncio.sleep(3600)

        tasks = [asyncio.ensure_future(vanishing_client(stub, audio, n, never)) for n in range(clients)]
        waiting = asyncio.ensure_future(all_open.wait())
        await asyncio.wait([waiting, *tasks], timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if not all_open.is_set():  # a session failed (or none opened in time): say why, not `ready`
            print(f"{opened} of {clients} sessions opened", flush=True)
            return
        print("ready", flush=True)
        await asyncio.gather(*tasks)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    asyncio.run(vanish_child(sys.argv[1], int(sys.argv[2])))
