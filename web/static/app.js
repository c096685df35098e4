// rtmedia browser page: one WebRTC peer connection to the bridge (microphone up,
// reply audio and demo video down) and the `events` data channel carrying the
// session's events in canonical JSON (docs/protocol.md#events). No build step.
//
// For automation: window.rtmedia.events holds every event received, in order, with
// `t_ms` (page clock) added; <body data-state> is idle | connecting | connected |
// closed | failed | error | token (the bridge wants an access token).
//
// Tokens: a bridge started with --auth-tokens answers 401 without one. The page then asks
// for it (the token form), keeps it in localStorage and sends it as `Authorization: Bearer`
// on /config, /offer and /peers/...; "Forget token" removes it.
"use strict";

const VOICED_RMS = 0.006; // about -45 dBFS: the same threshold `rtmedia talk` uses
const TOKEN_STORE = "rtmedia.token"; // localStorage key of the access token
const $ = (id) => document.getElementById(id);
let pageToken = ""; // the access token in use ("" without one)

function storedToken() {
  try { return localStorage.getItem(TOKEN_STORE) || ""; } catch { return ""; }
}

function storeToken(token) {
  try {
    if (token) localStorage.setItem(TOKEN_STORE, token);
    else localStorage.removeItem(TOKEN_STORE);
  } catch { /* storage disabled: the token lasts as long as the page */ }
  pageToken = token;
  $("forget-token").hidden = !token;
}

function authHeaders(headers = {}) {
  return pageToken ? { ...headers, Authorization: `Bearer ${pageToken}` } : headers;
}

class NeedToken extends Error {}

// fetch() with the token; a 401 asks for a (new) token and throws NeedToken.
async function bridgeFetch(path, options = {}) {
  const res = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
  if (res.status === 401) {
    const rejected = Boolean(pageToken);
    if (rejected) storeToken("");
    askForToken(rejected ? "The bridge did not accept that token: enter another." : "This bridge needs an access token.");
    throw new NeedToken("an access token is needed");
  }
  return res;
}

function askForToken(message) {
  $("token-prompt").textContent = message;
  $("token-form").hidden = false;
  $("token").value = "";
  $("token").focus();
}

const rtmedia = {
  events: [],
  latencies: [], // voice-to-voice, ms, one per reply
  pc: null,
  channel: null,
  peerId: null,
  state: "idle",
  send(event) {
    if (!this.channel || this.channel.readyState !== "open") throw new Error("not connected");
    this.channel.send(JSON.stringify(event));
  },
  async peerStats() {
    // GET /peers/{id}: this peer's statistics, as the bridge counts them.
    if (!this.peerId) return null;
    const res = await bridgeFetch(`/peers/${this.peerId}`);
    return res.ok ? res.json() : null;
  },
  async inboundAudio() {
    // Bytes and level of the reply audio as the browser received it (getStats inbound-rtp).
    if (!this.pc) return null;
    for (const s of (await this.pc.getStats()).values()) {
      if (s.type === "inbound-rtp" && s.kind === "audio") {
        return { bytesReceived: s.bytesReceived, packetsReceived: s.packetsReceived,
                 audioLevel: s.audioLevel, totalAudioEnergy: s.totalAudioEnergy };
      }
    }
    return null;
  },
};
window.rtmedia = rtmedia;

let mic = null;           // MediaStream from getUserMedia
let audioCtx = null;
let micAnalyser = null;
let replyAnalyser = null;
let meterTimer = null;
let muted = false;
let lastVoicedAt = 0;     // performance.now() of the last voiced microphone sample seen
let awaitingReply = null; // {responseId, since}: a reply whose first audible sample is awaited
const rows = new Map();   // transcript rows by item / response id

function setState(state, detail) {
  rtmedia.state = state;
  document.body.dataset.state = state;
  $("state").textContent = detail ? `${state} (${detail})` : state;
  const live = state === "connecting" || state === "connected";
  $("start").disabled = live;
  $("stop").disabled = !live;
  $("mute").disabled = state !== "connected";
  $("video-request").disabled = state !== "connected";
  $("talk").disabled = state !== "connected";
}

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.hidden = !message;
}

function row(key, role) {
  let li = rows.get(key);
  if (!li) {
    li = document.createElement("li");
    li.className = `${role} partial`;
    li.dataset.role = role;
    $("transcript").append(li);
    rows.set(key, li);
  }
  return li;
}

function scrollTranscript() {
  const list = $("transcript");
  list.scrollTop = list.scrollHeight;
}

function rms(analyser, buffer) {
  analyser.getFloatTimeDomainData(buffer);
  let sum = 0;
  for (const x of buffer) sum += x * x;
  return Math.sqrt(sum / buffer.length);
}

function startMeters(remoteStream) {
  audioCtx = new AudioContext();
  micAnalyser = audioCtx.createAnalyser();
  micAnalyser.fftSize = 512;
  audioCtx.createMediaStreamSource(mic).connect(micAnalyser);
  replyAnalyser = audioCtx.createAnalyser();
  replyAnalyser.fftSize = 512;
  audioCtx.createMediaStreamSource(remoteStream).connect(replyAnalyser);
  const buf = new Float32Array(512);
  meterTimer = setInterval(() => {
    const now = performance.now();
    const level = muted ? 0 : rms(micAnalyser, buf);
    $("level").value = Math.min(1, level * 4);
    if (level > VOICED_RMS && !awaitingReply) lastVoicedAt = now;
    if (awaitingReply && rms(replyAnalyser, buf) > VOICED_RMS) {
      const ms = Math.round(now - lastVoicedAt);
      rtmedia.latencies.push(ms);
      $("latency").textContent = `${ms} ms`;
      awaitingReply = null;
    }
  }, 10);
}

function onEvent(event) {
  event.t_ms = Math.round(performance.now());
  rtmedia.events.push(event);
  switch (event.type) {
    case "bridge.peer":
      rtmedia.peerId = event.peer_id;
      sendMode();
      break;
    case "conversation.item.input_audio_transcription.delta": {
      const li = row(event.item_id, "user");
      li.textContent += event.delta;
      scrollTranscript();
      break;
    }
    case "conversation.item.input_audio_transcription.completed": {
      const li = row(event.item_id, "user");
      li.textContent = event.transcript || "(nothing recognised)";
      li.classList.remove("partial");
      scrollTranscript();
      break;
    }
    case "response.created":
      // Voice-to-voice runs from the last voiced sample to the first audible reply sample.
      awaitingReply = { responseId: event.response_id };
      break;
    case "response.output_text.delta":
      row(event.response_id, "assistant").textContent += event.delta;
      scrollTranscript();
      break;
    case "response.output_text.done": {
      const li = row(event.response_id, "assistant");
      li.textContent = event.text;
      li.classList.remove("partial");
      break;
    }
    case "response.done":
      if (event.status !== "completed") {
        const li = row(event.response_id, "assistant");
        li.classList.remove("partial");
        li.classList.add("cut");
      }
      if (awaitingReply && awaitingReply.responseId === event.response_id && event.status !== "completed") {
        awaitingReply = null;
      }
      break;
    case "output_audio_buffer.cleared":
      if (awaitingReply && awaitingReply.responseId === event.response_id) awaitingReply = null;
      break;
    case "bridge.video.started":
      $("video-status").textContent = "decoding…";
      break;
    case "bridge.video.chunk":
      $("video-status").textContent = `chunk ${event.chunk_index + 1} of ${event.total_chunks}`;
      break;
    case "bridge.video.done":
      $("video-status").textContent = `${event.frames} frames decoded`;
      break;
    case "bridge.video.error":
      $("video-status").textContent = `video: ${event.message}`;
      break;
    case "error":
    case "bridge.error":
      showError(`${event.code}: ${event.message}`);
      break;
    case "session.closed":
      setState("closed", event.reason);
      break;
  }
}

function sendMode() {
  const mode = $("mode").value;
  $("talk").hidden = mode !== "manual";
  if (mode === "manual") setMic(false);
  else setMic(!muted);
  if (rtmedia.channel && rtmedia.channel.readyState === "open") {
    rtmedia.send({ type: "session.update", session: { turn_detection: { type: mode } } });
  }
}

function setMic(on) {
  if (mic) for (const track of mic.getAudioTracks()) track.enabled = on;
}

async function waitForIce(pc, timeoutMs = 3000) {
  if (pc.iceGatheringState === "complete") return;
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, timeoutMs);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") { clearTimeout(timer); resolve(); }
    });
  });
}

async function start() {
  showError("");
  setState("connecting");
  try {
    const config = await (await bridgeFetch("/config")).json();
    // ?processing=off turns the browser's echo cancellation, noise suppression and gain
    // control off (for a headset, or a test's fake microphone playing a file).
    const processing = new URLSearchParams(location.search).get("processing") !== "off";
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: processing, noiseSuppression: processing, autoGainControl: processing,
               channelCount: 1 },
    });
    const pc = new RTCPeerConnection({ iceServers: config.ice_servers || [] });
    rtmedia.pc = pc;
    const remote = new MediaStream();
    pc.addEventListener("track", (e) => {
      if (e.track.kind === "audio") {
        remote.addTrack(e.track);
        $("remote").srcObject = remote;
        startMeters(remote);
      } else {
        $("video").srcObject = new MediaStream([e.track]);
      }
    });
    pc.addEventListener("connectionstatechange", () => {
      const s = pc.connectionState;
      if (s === "connected") setState("connected");
      else if (s === "failed") { setState("failed"); showError("the connection to the bridge failed"); }
      else if (s === "closed" && rtmedia.state !== "closed") setState("closed");
    });
    for (const track of mic.getAudioTracks()) pc.addTrack(track, mic);
    pc.addTransceiver("video", { direction: "recvonly" });
    const channel = pc.createDataChannel("events");
    rtmedia.channel = channel;
    channel.addEventListener("message", (e) => {
      try { onEvent(JSON.parse(e.data)); } catch (err) { console.error("bad event", err, e.data); }
    });
    await pc.setLocalDescription(await pc.createOffer());
    await waitForIce(pc);
    const res = await bridgeFetch("/offer", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: "offer" }),
    });
    const body = await res.json();
    if (!res.ok) throw new Error(body.error || `the bridge answered ${res.status}`);
    rtmedia.peerId = body.id;
    await pc.setRemoteDescription({ sdp: body.sdp, type: "answer" });
  } catch (err) {
    if (err instanceof NeedToken) {
      await stop("token");
      return;
    }
    showError(err.message || String(err));
    await stop("error");
  }
}

function useToken(event) {
  event.preventDefault();
  const token = $("token").value.trim();
  if (!token) return;
  storeToken(token);
  $("token-form").hidden = true;
  $("token").value = "";
  start(); // the call the token was asked for
}

function forgetToken() {
  storeToken("");
  $("token-form").hidden = true;
  showError("");
}

async function stop(state = "closed") {
  const peerId = rtmedia.peerId;
  if (peerId) {
    fetch(`/peers/${peerId}`, { method: "DELETE", keepalive: true, headers: authHeaders() }).catch(() => {});
  }
  clearInterval(meterTimer);
  if (audioCtx) audioCtx.close();
  if (rtmedia.pc) rtmedia.pc.close();
  if (mic) for (const track of mic.getTracks()) track.stop();
  rtmedia.pc = rtmedia.channel = rtmedia.peerId = mic = audioCtx = null;
  awaitingReply = null;
  setState(state);
}

function pushToTalk(down) {
  if ($("mode").value !== "manual" || rtmedia.state !== "connected") return;
  const button = $("talk");
  if (down && !button.classList.contains("pressed")) {
    button.classList.add("pressed");
    rtmedia.send({ type: "input_audio_buffer.clear" });
    setMic(true);
  } else if (!down && button.classList.contains("pressed")) {
    button.classList.remove("pressed");
    setTimeout(() => { // let the last words reach the bridge before committing
      setMic(false);
      rtmedia.send({ type: "input_audio_buffer.commit" });
      rtmedia.send({ type: "response.create" });
    }, 250);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  storeToken(storedToken());
  $("token-form").addEventListener("submit", useToken);
  $("forget-token").addEventListener("click", forgetToken);
  $("start").addEventListener("click", start);
  $("stop").addEventListener("click", () => stop());
  $("mute").addEventListener("click", () => {
    muted = !muted;
    $("mute").setAttribute("aria-pressed", String(muted));
    $("mute").textContent = muted ? "Unmute" : "Mute";
    if ($("mode").value !== "manual") setMic(!muted);
  });
  $("mode").addEventListener("change", sendMode);
  const talk = $("talk");
  talk.addEventListener("pointerdown", () => pushToTalk(true));
  talk.addEventListener("pointerup", () => pushToTalk(false));
  talk.addEventListener("pointerleave", () => pushToTalk(false));
  talk.addEventListener("keydown", (e) => { if (e.key === " " || e.key === "Enter") { e.preventDefault(); pushToTalk(true); } });
  talk.addEventListener("keyup", (e) => { if (e.key === " " || e.key === "Enter") pushToTalk(false); });
  $("video-request").addEventListener("click", () => rtmedia.send({ type: "bridge.video.request" }));
  window.addEventListener("pagehide", () => { if (rtmedia.pc) stop(); });
  setState("idle");
});
