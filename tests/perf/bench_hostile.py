"""What hostile clients cost a real `rtmedia serve` (echo responder, or `--llm`): the server's
resident memory (its process tree) before, at the peak of, and after each attack, and the
sessions, threads and file descriptors left behind.

Attacks, one after the other on one server:
- `big_ids`: a client that never reads sends events whose `event_id` is 2 MiB (each one
  refused with an error that does not echo it);
- `errors`: a client that never reads sends 300,000 small events that are each answered by
  an `error` (a `response.cancel` with nothing to cancel), until the server closes it;
- `empty`: 300,000 empty requests;
- `vanishing`: rounds of 200 clients that open a session, speak, ask for a reply and vanish
  while it is answered (cancelling, closing their connection, or killed with SIGKILL). A
  first round warms the server up (its thread pools grow to their size on first use); the
  baseline is taken after it.

    .venv/bin/python tests/perf/bench_hostile.py [--rounds 5] [--llm]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.protocol.events import client_event  # noqa: E402
from rtmedia.v1 import realtime_pb2, realtime_pb2_grpc  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402

NON_READING = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024),
               ("grpc.max_send_message_length", 8 * 1024 * 1024)]


def tree(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            pids += tree(int(child))
    return pids


def rss_mib(pid: int, children_only: bool = False) -> float:
    total = 0
    for p in tree(pid)[1:] if children_only else tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return round(total / 1024, 1)


METRICS = {"rtmedia_sessions_active": "sessions_active", 'rtmedia_sessions_total{outcome="failed"}': "sessions_failed",
           'rtmedia_lm_slots{state="kept"}': "lm_slots_kept", 'rtmedia_lm_slots{state="busy"}': "lm_slots_busy",
           'rtmedia_lm_slots{state="waiting"}': "lm_waiting"}


def counts(pid: int, metrics_port: int) -> dict:
    """Threads, fds and processes of the server, and its session gauges from /metrics."""
    out: dict = {"threads": len(list(Path(f"/proc/{pid}/task").iterdir())),
                 "fds": len(list(Path(f"/proc/{pid}/fd").iterdir())), "processes": len(tree(pid)),
                 "workers_rss_mib": rss_mib(pid, children_only=True)}  # the ASR workers' decoders
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name in METRICS:
                out[METRICS[name]] = float(value)
    return out


async def watch(pid: int, metrics_port: int, attack, *args) -> dict:
    """Run `attack`, sampling the server's RSS every 50 ms; (before, peak, and 2 s after its
    last session ended), and how long after the attack that was."""
    before, peak = rss_mib(pid), 0.0
    task = asyncio.ensure_future(attack(*args))
    started = time.perf_counter()
    while not task.done():
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.05)
    detail = task.result()
    ended = time.perf_counter()
    while counts(pid, metrics_port).get("sessions_active") and time.perf_counter() - ended < 120:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    detail["sessions_released_s"] = round(time.perf_counter() - ended, 1)
    await asyncio.sleep(2)
    after = rss_mib(pid)
    return {**counts(pid, metrics_port), "rss_before_mib": before, "rss_peak_mib": max(peak, after), "rss_after_mib": after,
            "peak_growth_mib": round(max(peak, after) - before, 1), "seconds": round(time.perf_counter() - started, 1),
            **detail}


async def non_reading(target: str, requests, limit_s: float = 60) -> dict:
    async with grpc.aio.insecure_channel(target, options=NON_READING) as channel:
        call = realtime_pb2_grpc.RealtimeServiceStub(channel).Converse(requests)
        try:
            code = await asyncio.wait_for(call.code(), limit_s)
        except TimeoutError:
            call.cancel()
            return {"ended": f"no status at the client within {limit_s:g} s (it reads nothing)"}
        return {"ended": code.name}


async def big_ids(target: str) -> dict:
    async def requests():
        for n in range(500):
            yield client_event("response.cancel", event_id=f"{n:07d}" + "x" * (2 * 1024 * 1024 - 8))
    sent = await non_reading(target, requests())
    return {"events": 500, "uploaded_mib": 1000, **sent}


async def errors(target: str) -> dict:
    async def requests():
        for n in range(300_000):
            yield client_event("response.cancel", event_id=f"{n:0200d}")
            if n % 500 == 0:
                await asyncio.sleep(0)
    return {"events": 300_000, **await non_reading(target, requests())}


async def empty(target: str) -> dict:
    async def requests():
        for n in range(300_000):
            yield realtime_pb2.ConverseRequest()
            if n % 500 == 0:
                await asyncio.sleep(0)
    return {"events": 300_000, **await non_reading(target, requests(), limit_s=10)}


SPOKEN = "The quick brown fox jumps over the lazy dog."


def speech_audio() -> bytes:
    """A spoken sentence (16 kHz PCM16): enough for the VAD to start a turn and the ASR to
    lend its stream a decoder."""
    from tests.support.speech import Speaker

    return Speaker().say(SPOKEN).tobytes()


async def vanishing_client(stub, audio: bytes, n: int, vanish) -> None:
    """One session that speaks, asks for a reply (which takes an LM slot and a TTS stream)
    and vanishes (`vanish(call)`) 0-1.6 s later: while it speaks or is answered."""
    queue: asyncio.Queue = asyncio.Queue()
    for at in range(0, len(audio), 3200):
        queue.put_nowait(client_event("input_audio_buffer.append", audio=audio[at:at + 3200]))
    queue.put_nowait(client_event("conversation.item.create", item={"text": "Tell me a story."}))
    queue.put_nowait(client_event("response.create"))

    async def requests():
        while True:
            yield await queue.get()

    call = stub.Converse(requests())
    await anext(aiter(call))  # session.created
    await asyncio.sleep(0.4 * (n % 5))
    await vanish(call)


async def vanishing(target: str, audio: bytes, clients: int = 200) -> dict:
    """`clients` sessions, vanishing in three ways: a third cancel their call, a third close
    their own connection, a third are in a process killed with SIGKILL (the kernel closes
    its sockets)."""
    third = clients // 3
    killed = await asyncio.create_subprocess_exec(sys.executable, __file__, "--vanish-child", target, str(third),
                                                  stdout=asyncio.subprocess.PIPE)
    async with grpc.aio.insecure_channel(target) as shared:
        stub = realtime_pb2_grpc.RealtimeServiceStub(shared)

        async def cancel(call) -> None:
            call.cancel()

        async def own_connection(n: int) -> None:
            channel = grpc.aio.insecure_channel(target)

            async def close(call) -> None:
                await channel.close(grace=None)

            await vanishing_client(realtime_pb2_grpc.RealtimeServiceStub(channel), audio, n, close)

        ready = killed.stdout.readline()
        outcomes = await asyncio.gather(*(vanishing_client(stub, audio, n, cancel) for n in range(third)),
                                        *(own_connection(n) for n in range(clients - 2 * third)), ready,
                                        return_exceptions=True)
    killed.kill()
    await killed.wait()
    failed = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    if failed or outcomes[-1] != b"ready\n":
        raise RuntimeError(f"{len(failed)} vanishing clients failed before vanishing: {failed[:3]}; "
                           f"the killed process said {outcomes[-1]!r}")
    return {"clients": clients}


async def vanish_child(target: str, clients: int) -> None:
    """The `--vanish-child` process: open the sessions, say so on stdout, wait to be killed."""
    audio = speech_audio()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = realtime_pb2_grpc.RealtimeServiceStub(channel)
        opened = asyncio.Event()

        async def never(call) -> None:
            await opened.wait()
            await asyncio.sleep(3600)

        tasks = [asyncio.ensure_future(vanishing_client(stub, audio, n, never)) for n in range(clients)]
        await asyncio.sleep(2)
        print("ready", flush=True)
        await asyncio.gather(*tasks)


async def run(rounds: int, llm: bool, non_reading_attacks: bool) -> dict:
    metrics_port = free_port()
    audio = speech_audio()
    responder = () if llm else ("--no-llm", "--responder", "echo")
    with running_server("--metrics-port", str(metrics_port), *responder, "--max-sessions", "3000",
                        "--log-level", "WARNING") as (target, server):
        pid = server.pid
        await asyncio.sleep(2)
        result: dict = {"fresh": {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}}
        if rounds:  # thread pools and caches grow to their working size on first use
            result["warm_up"] = await watch(pid, metrics_port, vanishing, target, audio)
        baseline = result["baseline"] = {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}
        for name, attack in (("big_ids", big_ids), ("errors", errors), ("empty", empty))[:3 * non_reading_attacks]:
            result[name] = await watch(pid, metrics_port, attack, target)
        result["vanishing"] = []
        for _ in range(rounds):
            result["vanishing"].append(await watch(pid, metrics_port, vanishing, target, audio))
        after = result["after"] = {"rss_mib": rss_mib(pid), **counts(pid, metrics_port)}
        after["rss_vs_baseline"] = round(after["rss_mib"] / baseline["rss_mib"], 3)
        after["rss_vs_first_round"] = round(after["rss_mib"] / result["vanishing"][0]["rss_after_mib"], 3) \
            if rounds else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 200 vanishing clients")
    parser.add_argument("--llm", action="store_true", help="serve the embedded LM (default: the echo responder)")
    parser.add_argument("--vanishing-only", action="store_true", help="skip the non-reading clients")
    parser.add_argument("--vanish-child", nargs=2, metavar=("TARGET", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vanish_child:
        asyncio.run(vanish_child(args.vanish_child[0], int(args.vanish_child[1])))
        return
    result = asyncio.run(run(args.rounds, args.llm, not args.vanishing_only))
    print(json.dumps({"machine": machine(), **result}, indent=1))


if __name__ == "__main__":
    main()
