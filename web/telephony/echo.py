"""Echo cancellation at the SIP door (docs/telephony.md#echo-cancellation).

A caller on a speakerphone (or a cheap handset) sends the agent's reply back in their
microphone's audio. To the server that echo is speech during a reply: a barge-in that cuts the
reply, and a "turn" the agent may answer, talking to itself. The door paces the reply itself,
so it holds the far-end reference the echo canceller needs: every frame the media clock plays
to the caller goes to WebRTC's echo canceller (AEC3, in LiveKit's build of WebRTC's audio
processing module, `rtc.AudioProcessingModule`) as the reverse stream, and every frame heard
from the caller has that frame's echo removed before it is sent on. Both happen on the media
clock's thread, in the order the clock plays and hears them, so one canceller per call is used
by one thread. AEC3 estimates the echo path's delay itself (the network's and the phone's
buffers in both directions); the delay hint stays 0.
"""

from __future__ import annotations

import numpy as np


class EchoCanceller:
    """One call's echo canceller on 20 ms PCM16 mono frames at `rate` (8 or 16 kHz), run as
    two 10 ms frames each (what the module takes)."""

    def __init__(self, rate: int) -> None:
        from livekit import rtc

        self.apm = rtc.AudioProcessingModule(echo_cancellation=True, high_pass_filter=True)
        self.apm.set_stream_delay_ms(0)
        self.samples = rate // 100
        # One frame object each way, reused: the module rewrites its buffer in place.
        self._far = rtc.AudioFrame(bytearray(self.samples * 2), rate, 1, self.samples)
        self._near = rtc.AudioFrame(bytearray(self.samples * 2), rate, 1, self.samples)
        self._near_pcm = np.frombuffer(self._near.data, np.int16)
        self._far_pcm = np.frombuffer(self._far.data, np.int16)

    def played(self, pcm: bytes) -> None:
        """A frame the caller is played (the reference)."""
        x = np.frombuffer(pcm, np.int16)
        for i in range(0, x.size - self.samples + 1, self.samples):
            self._far_pcm[:] = x[i : i + self.samples]
            self.apm.process_reverse_stream(self._far)

    def heard(self, pcm: bytes) -> bytes:
        """A frame from the caller, its echo removed."""
        x = np.frombuffer(pcm, np.int16).copy()
        for i in range(0, x.size - self.samples + 1, self.samples):
            self._near_pcm[:] = x[i : i + self.samples]
            self.apm.process_stream(self._near)
            x[i : i + self.samples] = self._near_pcm
        return x.tobytes()
