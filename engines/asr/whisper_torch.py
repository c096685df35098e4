"""Whisper on torch: the `torch` backend of the Whisper engine (`engines/asr/whisper.py`).

It implements the engine's `WhisperBackend` protocol as `CTranslate2Backend` does, so one engine
(batching, buckets, streaming, guards) runs on either runtime. The weights come from a
CTranslate2 Whisper directory (`model.bin`, read here without CTranslate2: `read_ctranslate2`)
or from a transformers Whisper directory; either way they are held by transformers'
`WhisperForConditionalGeneration` (the CTranslate2 tensors map exactly onto it:
`state_dict_from_ctranslate2`). The forward passes are this module's own, over that model's
layers: transformers refuses encoder inputs shorter than Whisper's 30 s, and the engine encodes
trimmed windows (the encoder here slices the position table to the window's length).

The decoding follows CTranslate2's Whisper, so both backends give the same text:
- `generate`: the prompt up to `<|startoftranscript|>` fills the KV cache, and the no-speech
  probability is the softmax of the logits at that token (the step that predicts the first
  task token); greedy decoding starts from the last prompt token, with the config's
  `suppress_ids` masked at every step and `suppress_ids_begin` (blank and end of text) at the
  first (`suppress_blank`); a decode's score is the sum of its tokens' log-probabilities (end of
  text included, after masking) over its length, as CTranslate2 returns it, and `Decoded`'s
  `avg_logprob` is that over the length again, as `CTranslate2Backend` reports it. On the
  growing cache, a decode that has ended leaves the batch (the static one keeps its shape).
- `align`: the sequence `start + <|notimestamps|> + text + <|endoftext|>` in one pass; the
  alignment heads' cross-attention over the window's content (softmax over the content's
  positions), standardised along the tokens, median-filtered along time (width 7, reflected
  edges), averaged over the heads, and a DTW path through its negation; the text tokens'
  probabilities are softmaxed over the text vocabulary only.

On a CPU it runs eagerly in float32 (float16 files are widened), the decoder's KV cache grown
by concatenation. On CUDA (float16 by default) both halves are fixed-shape steps a CUDA graph can
replay, through the engine's `GraphRunner` (`engines/graphs.py`: capture on a shape's second
call, a cap on graphs and a free-memory floor, eager fallback, counted replays and misses):
- the encoder, per (batch, frames) bucket: a batch is padded to a power of two up to 16 (the
  padding rows repeat the first and are dropped), the frames are the engine's whole seconds;
- the decoder step on a static KV cache (`_StaticDecode`), per (batch, encoder positions,
  cache length) shape: the cache and the cross-attention keys and values are buffers the step
  reads and writes in place, the position a device tensor; the prompt fills the cache eagerly.
A shape's buffers live as long as its graph; without one (a miss) they are the call's own.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rtmedia.engines.asr.whisper_model import Decoded, embedded_model_dir, language_tokens, model_format
from rtmedia.engines.base import EngineError

_MEDIAN_WIDTH = 7  # CTranslate2's and openai-whisper's median filter over the attention
_CT2_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")  # the file's type ids
COMPUTE_TYPES = ("float32", "float16", "bfloat16", "int8")
_BATCH_BUCKETS = (1, 2, 4, 8, 16)  # graphed batches are padded up to one of these
_CACHE_BLOCK = 64  # a static KV cache's length is a multiple of this


def read_ctranslate2(path: Path) -> dict[str, np.ndarray]:
    """The variables of a CTranslate2 `model.bin` (the layout `ctranslate2.specs.ModelSpec`
    writes: version, name, revision, then each variable's name, shape, type id and bytes, then
    aliases), aliases resolved; bfloat16 is widened to float32, int8 weights are dequantised
    with their `weight_scale`."""
    data = Path(path).read_bytes()
    offset = 0

    def take(fmt: str) -> int:
        nonlocal offset
        (value,) = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal offset
        size = take("H")
        text = data[offset : offset + size - 1].decode()
        offset += size
        return text

    version = take("I")
    if version < 5:
        raise ValueError(f"{path}: CTranslate2 model format {version} is too old (5 or newer is read)")
    string()  # the spec's name
    take("I")  # its revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(take("I")):
        name = string()
        shape = [take("I") for _ in range(take("B"))]
        kind = _CT2_DTYPES[take("B")]
        size = take("I")
        raw = data[offset : offset + size]
        offset += size
        if kind == "bfloat16":
            value = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            value = np.frombuffer(raw, dtype=np.dtype(kind).newbyteorder("<"))
        variables[name] = value.reshape(shape)
    for _ in range(take("I")):
        alias = string()
        variables[alias] = variables[string()]
    for name in [n for n in variables if n.endswith("/weight_scale")]:
        weight = name.removesuffix("_scale")
        if variables[weight].dtype == np.int8:
            scale = variables.pop(name).astype(np.float32)
            variables[weight] = variables[weight].astype(np.float32) / \
                scale.reshape(-1, *[1] * (variables[weight].ndim - 1))
    return variables


def state_dict_from_ctranslate2(variables: dict[str, np.ndarray]) -> dict[str, Any]:
    """transformers' `WhisperForConditionalGeneration` state dict (float32) of CTranslate2's
    Whisper variables: fused q, k, v split (k has no bias), cross-attention `linear_0` the query
    and `linear_1` the fused key and value, the projection tied to the embeddings."""
    import torch

    def t(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(variables[name], dtype=np.float32))

    state: dict[str, torch.Tensor] = {}

    def norm(prefix: str, source: str) -> None:
        state[prefix + ".weight"], state[prefix + ".bias"] = t(source + "/gamma"), t(source + "/beta")

    def linear(prefix: str, source: str) -> None:
        state[prefix + ".weight"], state[prefix + ".bias"] = t(source + "/weight"), t(source + "/bias")

    def fused(prefixes: list[str], source: str) -> None:
        weights = t(source + "/weight").chunk(len(prefixes))
        biases = t(source + "/bias").chunk(len(prefixes))
        for prefix, weight, bias in zip(prefixes, weights, biases, strict=True):
            state[prefix + ".weight"] = weight.contiguous()
            if not prefix.endswith("k_proj"):
                state[prefix + ".bias"] = bias.contiguous()

    for side in ("encoder", "decoder"):
        layers = sum(1 for n in variables if n.startswith(f"{side}/layer_") and n.endswith("ffn/linear_0/weight"))
        for i in range(layers):
            src, dst = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            fused([f"{dst}.self_attn.{p}_proj" for p in "qkv"], f"{src}/self_attention/linear_0")
            linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
            norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
            if side == "decoder":
                linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
                fused([f"{dst}.encoder_attn.{p}_proj" for p in "kv"], f"{src}/attention/linear_1")
                linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
                norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
            linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
            linear(f"{dst}.fc2", f"{src}/ffn/linear_1")
            norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        state[f"model.{side}.embed_positions.weight"] = t(f"{side}/position_encodings/encodings")
    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    state["model.decoder.embed_tokens.weight"] = t("decoder/embeddings/weight")
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    return state


def whisper_config(state: dict[str, Any], heads: int) -> Any:
    """The `WhisperConfig` of a state dict (its sizes read off the tensors)."""
    from transformers import WhisperConfig

    vocab, d_model = state["model.decoder.embed_tokens.weight"].shape

    def count(side: str) -> int:
        return sum(1 for n in state if n.startswith(f"model.{side}.layers.") and n.endswith(".fc1.weight"))

    return WhisperConfig(
        vocab_size=vocab, num_mel_bins=state["model.encoder.conv1.weight"].shape[1], d_model=d_model,
        encoder_layers=count("encoder"), decoder_layers=count("decoder"), encoder_attention_heads=heads,
        decoder_attention_heads=heads, encoder_ffn_dim=state["model.encoder.layers.0.fc1.weight"].shape[0],
        decoder_ffn_dim=state["model.decoder.layers.0.fc1.weight"].shape[0],
        max_source_positions=state["model.encoder.embed_positions.weight"].shape[0],
        max_target_positions=state["model.decoder.embed_positions.weight"].shape[0],
        bos_token_id=50256, eos_token_id=50256, pad_token_id=50256, decoder_start_token_id=50257,
        tie_word_embeddings=True)


@dataclass(slots=True)
class Alignment:
    """One decode's alignment, as CTranslate2's `WhisperAlignmentResult` has it."""

    alignments: list[tuple[int, int]] = field(default_factory=list)  # (text token index, time index)
    text_token_probs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Tokens:
    """The special tokens and suppression lists the decoding needs."""

    sot: int
    no_timestamps: int
    eot: int
    no_speech: int
    suppress: list[int]
    suppress_begin: list[int]
    alignment_heads: list[tuple[int, int]]
    languages: list[int]  # the language tokens' ids, and their texts ("<|fr|>")
    language_tokens: list[str]


class TorchBackend:
    """Whisper on torch: the engine's `WhisperBackend` (module docstring). `path` is a
    CTranslate2 Whisper directory (`model.bin`, `config.json`) or a transformers one; special
    tokens come from its tokenizer or vocabulary (`_token_ids`). `compute_type`: float32 (the
    CPU's default), float16 (CUDA's), bfloat16, or int8 on a CPU (every linear layer per-row
    int8, `engines/lm/quant.py`). `threads` sets torch's intra-op threads, which
    are the whole process's. `graphs`: a `GraphRunner` for the encoder and the decoder step (built with
    `eager_after_failure`: a failed capture never fails a decode);
    `static`: decode on a static KV cache (default: on CUDA)."""

    runtime = "torch"

    def __init__(self, path: Path | None = None, device: str = "cpu", compute_type: str = "",
                 threads: int | None = None, graphs: Any = None, static: bool | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        path = Path(path or embedded_model_dir())
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.compute_type = compute_type or ("float16" if cuda else "float32")
        if self.compute_type not in COMPUTE_TYPES:
            raise EngineError(f"compute type {self.compute_type!r}: the torch backend runs {', '.join(COMPUTE_TYPES)}")
        if self.compute_type == "int8" and cuda:
            raise EngineError("compute type 'int8' is the torch backend's CPU path (per-row int8 matmuls); on CUDA "
                              "it runs float16, bfloat16 or float32")
        self.dtype = torch.float32 if self.compute_type == "int8" else getattr(torch, self.compute_type)
        self.model, config = _load(path)
        self.model.to(self.device, self.dtype).eval()
        if self.compute_type == "int8":  # every linear layer, the output projection included
            from rtmedia.engines.lm.quant import quantize_linears

            quantize_linears(self.model)
        self.heads = self.model.config.decoder_attention_heads
        self.n_mels = self.model.config.num_mel_bins
        self.multilingual = self.model.config.vocab_size >= 51865  # English-only Whisper has 51864
        self.tokens = _special_tokens(path, config, self.model.config)
        self.graphs = graphs
        self.static = cuda if static is None else static
        self._states: dict[tuple[int, int, int], _StaticDecode] = {}  # the shapes that have a graph
        self._states_mu = threading.Lock()

    # -- the backend protocol ----------------------------------------------------------------

    def encode(self, features: np.ndarray) -> Any:
        """Encoder states [batch, frames / 2, d_model] of log-mel windows of any length up to
        the model's (the position table is sliced to the window); graphed per padded batch."""
        torch = self._torch
        if features.shape[-1] // 2 > self.model.model.encoder.embed_positions.weight.shape[0]:
            raise ValueError(f"a window of {features.shape[-1]} frames is longer than the model's")
        with torch.inference_mode():
            x = torch.as_tensor(np.ascontiguousarray(features), device=self.device, dtype=self.dtype)
            if self.graphs is None:
                return self._encode(x)
            if not self.graphs.eligible((x,)):  # (a CPU: no padding for a graph that cannot be)
                return self.graphs.eager(self._encode, x)
            n = x.shape[0]
            return self.graphs.run(self._encode, _pad_rows(x, padded_batch(n)), tag="encoder")[:n]

    def _encode(self, x: Any) -> Any:
        F = self._torch.nn.functional
        encoder = self.model.model.encoder
        x = F.gelu(encoder.conv1(x))
        x = F.gelu(encoder.conv2(x)).transpose(1, 2)
        x = x + encoder.embed_positions.weight[: x.shape[1]]
        for layer in encoder.layers:
            h = layer.self_attn_layer_norm(x)
            x = x + layer.self_attn.out_proj(self._attend(layer.self_attn, h, h))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        return encoder.layer_norm(x)

    def detect_language(self, encoded: Any) -> list[str]:
        """Each window's most probable language token: the first step's logits after
        `<|startoftranscript|>`, over the language tokens."""
        torch, tk = self._torch, self.tokens
        if not tk.languages:
            raise ValueError("an English-only model detects no language")
        with torch.inference_mode():
            ids = torch.full((encoded.shape[0], 1), tk.sot, device=self.device)
            hidden, _ = self._decoder(ids, 0, self._cross(encoded), None)
            best = self._logits(hidden[:, -1])[:, tk.languages].argmax(-1)
        return [tk.language_tokens[i] for i in best.tolist()]

    def generate(self, encoded: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[Decoded]:
        """Greedy decodes as CTranslate2's `generate(beam_size=1, return_scores=True,
        return_no_speech_prob=True, suppress_blank=True)` with `CTranslate2Backend`'s
        `max_length` (module docstring)."""
        torch = self._torch
        tk = self.tokens
        length, sot, max_length = self._lengths(prompts, max_tokens)
        batch = len(prompts)
        if self.static:
            padded = padded_batch(batch) if self.graphs is not None and self.graphs.eligible((encoded,)) else batch
            prompts = prompts + [prompts[0]] * (padded - batch)
            encoded = _pad_rows(encoded, padded)
        with torch.inference_mode():
            cross = self._cross(encoded)
            cache: list[list[Any]] = [[None, None] for _ in self.model.model.decoder.layers]
            ids = torch.tensor(prompts, device=self.device)
            no_speech = None
            if length > 1:
                hidden, _ = self._decoder(ids[:, :-1], 0, cross, cache)
                no_speech = self._logits(hidden[:, sot]).softmax(-1)[:, tk.no_speech]
            position = torch.tensor([length - 1], device=self.device)  # (the static step's)
            mask = torch.zeros(self.model.config.vocab_size, device=self.device, dtype=torch.bool)
            mask[tk.suppress] = True
            mask_begin = mask.clone()
            mask_begin[tk.suppress_begin] = True
            step_ids = ids[:, -1:]
            scores = torch.zeros(len(prompts), dtype=torch.float64)
            done = torch.zeros(len(prompts), dtype=torch.bool)
            out: list[list[int]] = [[] for _ in range(len(prompts))]
            rows = list(range(len(prompts)))  # the rows each step computes (eager: the unfinished ones)
            state = self._static(len(prompts), cross, cache, length + max_length) if self.static else None
            try:
                for step in range(max_length):
                    if state is None:
                        hidden, _ = self._decoder(step_ids, length - 1 + step, cross, cache)
                        logits = self._logits(hidden[:, -1]).float()
                    else:
                        logits = state.run(step_ids, position)
                        position += 1
                    if no_speech is None:
                        no_speech = logits.softmax(-1)[:, tk.no_speech]
                    logits = logits.masked_fill(mask_begin if step == 0 else mask, -math.inf)
                    logprobs = logits.log_softmax(-1)
                    best = logprobs.argmax(-1)
                    best_lp = logprobs.gather(1, best[:, None])[:, 0].double().cpu()
                    for j, token in enumerate(best.tolist()):
                        i = rows[j]
                        if done[i]:
                            continue
                        scores[i] += best_lp[j]
                        if token == tk.eot:
                            done[i] = True
                        else:
                            out[i].append(token)
                    if bool(done[:batch].all()):
                        break
                    keep = [j for j, i in enumerate(rows) if not done[i]]
                    if state is None and len(keep) < len(rows):  # finished decodes leave the batch
                        index = torch.tensor(keep, device=self.device)
                        cross = [(k[index], v[index]) for k, v in cross]
                        cache = [[k[index], v[index]] for k, v in cache]
                        rows, best = [rows[j] for j in keep], best[index]
                    step_ids = best[:, None]
            finally:
                if state is not None:
                    state.release()
        probs = no_speech.float().cpu().tolist()
        return self._decoded(out[:batch], scores.tolist()[:batch], max_tokens, probs[:batch])

    def _lengths(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[int, int, int]:
        """A batch's prompt length, where its start-of-transcript token is, and the tokens it may
        generate (CTranslate2's `max_length`); ValueError for prompts the decode cannot take."""
        tk = self.tokens
        length = len(prompts[0])
        if any(len(p) != length for p in prompts):
            raise ValueError("a batch's prompts must be of one length")
        sot = prompts[0].index(tk.sot)
        begin = sot
        while begin < length and tk.sot <= prompts[0][begin] <= tk.no_timestamps:
            begin += 1
        if begin != length:
            raise ValueError("a prompt ends with its task tokens (no text after them)")
        total = max(max_tokens) + 4 + length
        max_length = min(total // 2, total - (length - 1))
        if length + max_length > self.model.config.max_target_positions:
            raise ValueError(f"a prompt of {length} tokens and {max_length} more pass the model's "
                             f"{self.model.config.max_target_positions} positions")
        return length, sot, max_length

    @staticmethod
    def _decoded(out: list[list[int]], scores: list[float], max_tokens: list[int], probs: list[float]
                 ) -> list[Decoded]:
        """Each row's tokens (up to its cap) with CTranslate2's score (length penalty 1)."""
        results = []
        for tokens, score, cap, prob in zip(out, scores, max_tokens, probs, strict=True):
            score = score / len(tokens) if tokens else -math.inf
            results.append(Decoded(tokens[:cap], score / max(1, len(tokens)), prob))
        return results

    def align(self, encoded: Any, start: list[int], tokens: list[list[int]], frames: list[int]) -> list[Alignment]:
        """Word-timing alignment as CTranslate2's `Whisper.align` (median filter width 7)."""
        torch = self._torch
        tk = self.tokens
        if not tokens:
            return []
        sequences = [[*start, tk.no_timestamps, *text, tk.eot] for text in tokens]
        longest = max(map(len, sequences))
        ids = torch.tensor([s + [tk.eot] * (longest - len(s)) for s in sequences], device=self.device)
        results = []
        with torch.inference_mode():
            hidden, weights = self._decoder(ids, 0, self._cross(encoded), None, tk.alignment_heads)
            logits = self._logits(hidden).float()[..., : tk.eot]
            probs = logits.softmax(-1)
            for b, (seq, text, n_frames) in enumerate(zip(sequences, tokens, frames, strict=True)):
                targets = torch.tensor(seq[1:], device=self.device)
                token_probs = probs[b, torch.arange(len(targets), device=self.device),
                                    targets.clamp(max=tk.eot - 1)]
                token_probs = token_probs.cpu().tolist()[len(start) : len(start) + len(text)]
                content = n_frames // 2
                pairs: list[tuple[int, int]] = []
                if content:
                    w = weights[b, :, : len(seq), :content].float().softmax(-1)
                    w = (w - w.mean(-2, keepdim=True)) / w.var(-2, unbiased=False, keepdim=True).sqrt()
                    w = _median_filter(w, _MEDIAN_WIDTH).mean(0)
                    matrix = w[len(start) : len(start) + len(text) + 1].cpu().numpy()
                    pairs = negative_dtw(matrix)
                results.append(Alignment(pairs, token_probs))
        return results

    # -- the forward passes ------------------------------------------------------------------

    def _attend(self, attn: Any, x: Any, memory: Any) -> Any:
        """Multi-head attention of `x` over `memory` (no mask): transformers' projections."""
        F = self._torch.nn.functional
        q, k, v = (self._split(p) for p in (attn.q_proj(x), attn.k_proj(memory), attn.v_proj(memory)))
        return self._merge(F.scaled_dot_product_attention(q, k, v))

    def _split(self, x: Any) -> Any:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    @staticmethod
    def _merge(x: Any) -> Any:
        b, h, t, d = x.shape
        return x.transpose(1, 2).reshape(b, t, h * d)

    def _cross(self, encoded: Any) -> list[tuple[Any, Any]]:
        """Each decoder layer's cross-attention keys and values of the encoder states."""
        encoded = encoded.to(self.device, self.dtype)
        return [(self._split(layer.encoder_attn.k_proj(encoded)), self._split(layer.encoder_attn.v_proj(encoded)))
                for layer in self.model.model.decoder.layers]

    def _decoder(self, ids: Any, offset: int, cross: list[tuple[Any, Any]], cache: list[list[Any]] | None,
                 heads: list[tuple[int, int]] | None = None) -> tuple[Any, Any]:
        """Decoder states of `ids` at positions from `offset`: with a KV `cache` (extended in
        place) one step or prompt at a time; without, the whole sequence causally. With `heads`,
        also those (layer, head) cross-attention logits [batch, heads, tokens, frames]."""
        torch, F = self._torch, self._torch.nn.functional
        decoder = self.model.model.decoder
        x = decoder.embed_tokens(ids) + decoder.embed_positions.weight[offset : offset + ids.shape[1]]
        picked = []
        for i, layer in enumerate(decoder.layers):
            h = layer.self_attn_layer_norm(x)
            q, k, v = (self._split(p) for p in (layer.self_attn.q_proj(h), layer.self_attn.k_proj(h),
                                                layer.self_attn.v_proj(h)))
            if cache is not None and cache[i][0] is not None:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
            if cache is not None:
                cache[i][0], cache[i][1] = k, v
            causal = q.shape[2] > 1
            if causal and k.shape[2] != q.shape[2]:
                raise ValueError("a prompt goes into an empty cache")
            x = x + layer.self_attn.out_proj(self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
            h = layer.encoder_attn_layer_norm(x)
            q = self._split(layer.encoder_attn.q_proj(h))
            ck, cv = cross[i]
            x = x + layer.encoder_attn.out_proj(self._merge(F.scaled_dot_product_attention(q, ck, cv)))
            mine = [head for lay, head in heads or [] if lay == i]
            if mine:
                picked.append((q[:, mine] @ ck[:, mine].transpose(-1, -2)) / math.sqrt(q.shape[-1]))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        return decoder.layer_norm(x), (torch.cat(picked, 1) if picked else None)

    def _logits(self, hidden: Any) -> Any:
        return self.model.proj_out(hidden)  # (tied to the token embeddings)

    def _static(self, batch: int, cross: list[tuple[Any, Any]], cache: list[list[Any]], needed: int) -> _StaticDecode:
        """The static buffers of this shape, filled with the cross-attention keys and values and
        the prompt's cache, and held (`release`) until the decode ends: the ones a graph reads
        when the runner has captured this shape, else new ones."""
        length = min(self.model.config.max_target_positions, -(-needed // _CACHE_BLOCK) * _CACHE_BLOCK)
        key = (batch, cross[0][0].shape[2], length)
        with self._states_mu:
            state = self._states.get(key)
            if state is None:
                self._prune()
                state = self._states[key] = _StaticDecode(self, key, runner_buffers=self.graphs is not None)
            if not state.take():  # another decode of this shape holds them: eager on buffers of its own
                state = _StaticDecode(self, key, runner_buffers=False)
                state.take()
        state.fill(cross, cache)
        return state

    def _prune(self) -> None:
        """Drop the idle buffers of shapes without a graph once there are as many as the
        runner may capture (a graph's buffers stay: it reads and writes them)."""
        limit = max(4, self.graphs.config.max_graphs) if self.graphs is not None else 0
        if len(self._states) < limit:
            return
        for key, state in list(self._states.items()):
            if not (self.graphs is not None and self.graphs.has_tag(("decoder", *key))) and state.take():
                del self._states[key]  # held forever: a decode that still had them has ended


class _StaticDecode:
    """The decoder step of one (batch, encoder positions, cache length) shape on buffers it
    reads and writes in place (module docstring): the self-attention KV cache [layers, batch,
    heads, length, head size] and the cross-attention keys and values. One decode at a time
    holds it (`take` / `release`). `runner_buffers`: the shape's buffers in the backend, which
    its graph (once captured) reads and writes; others run eagerly."""

    def __init__(self, backend: TorchBackend, key: tuple[int, int, int], runner_buffers: bool) -> None:
        torch = backend._torch
        batch, positions, length = key
        config = backend.model.config
        size = config.d_model // backend.heads
        shape = (config.decoder_layers, batch, backend.heads)
        make = dict(device=backend.device, dtype=backend.dtype)
        self.backend, self.key, self.runner_buffers = backend, key, runner_buffers
        self.k, self.v = torch.zeros(*shape, length, size, **make), torch.zeros(*shape, length, size, **make)
        self.ck, self.cv = torch.zeros(*shape, positions, size, **make), torch.zeros(*shape, positions, size, **make)
        self.slots = torch.arange(length, device=backend.device)
        self._busy = threading.Lock()

    def take(self) -> bool:
        return self._busy.acquire(blocking=False)

    def release(self) -> None:
        self._busy.release()

    def fill(self, cross: list[tuple[Any, Any]], cache: list[list[Any]]) -> None:
        for i, ((ck, cv), (k, v)) in enumerate(zip(cross, cache, strict=True)):
            self.ck[i].copy_(ck)
            self.cv[i].copy_(cv)
            if k is not None:
                self.k[i, :, :, : k.shape[2]].copy_(k)
                self.v[i, :, :, : v.shape[2]].copy_(v)

    def run(self, ids: Any, position: Any) -> Any:
        """The next-token logits (float32 [batch, vocab]) of `ids` [batch, 1] at `position` [1]:
        through the runner (a graph of this shape, or eagerly) when these are the shape's
        runner buffers, else eagerly."""
        graphs = self.backend.graphs
        if graphs is None:
            return self.step(ids, position)
        if not self.runner_buffers:
            return graphs.eager(self.step, ids, position)
        return graphs.run(self.step, ids, position, tag=("decoder", *self.key))

    def step(self, ids: Any, position: Any) -> Any:
        b = self.backend
        F = b._torch.nn.functional
        decoder = b.model.model.decoder
        x = decoder.embed_tokens(ids) + decoder.embed_positions.weight.index_select(0, position)
        visible = (self.slots <= position)[None]  # the cache's filled positions, this one's included
        for i, layer in enumerate(decoder.layers):
            h = layer.self_attn_layer_norm(x)
            q, k, v = (b._split(p) for p in (layer.self_attn.q_proj(h), layer.self_attn.k_proj(h),
                                             layer.self_attn.v_proj(h)))
            self.k[i].index_copy_(2, position, k)
            self.v[i].index_copy_(2, position, v)
            x = x + layer.self_attn.out_proj(b._merge(F.scaled_dot_product_attention(q, self.k[i], self.v[i],
                                                                                     attn_mask=visible)))
            h = layer.encoder_attn_layer_norm(x)
            q = b._split(layer.encoder_attn.q_proj(h))
            x = x + layer.encoder_attn.out_proj(b._merge(F.scaled_dot_product_attention(q, self.ck[i], self.cv[i])))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
        return b._logits(decoder.layer_norm(x)[:, -1]).float()


def padded_batch(n: int) -> int:
    """The graphed batch size a batch of `n` runs as: the next of `_BATCH_BUCKETS` (beyond 16, `n`)."""
    return next((b for b in _BATCH_BUCKETS if b >= n), n)


def _pad_rows(x: Any, rows: int) -> Any:
    """`x` with its first row repeated up to `rows` rows."""
    if x.shape[0] >= rows:
        return x
    import torch

    return torch.cat([x, x[:1].expand(rows - x.shape[0], *x.shape[1:])])


def _median_filter(x: Any, width: int) -> Any:
    """A median filter along the last axis with reflected edges (CTranslate2's; an axis no
    longer than half the width passes through)."""
    import torch.nn.functional as F

    rank = width // 2
    if x.shape[-1] <= rank:
        return x
    shape = x.shape
    padded = F.pad(x.reshape(-1, 1, shape[-1]), (rank, rank), mode="reflect")
    return padded.unfold(-1, width, 1).median(-1).values.reshape(shape)


def negative_dtw(x: np.ndarray) -> list[tuple[int, int]]:
    """The cheapest monotonic path through `-x` (CTranslate2's `negative_dtw`, its ties and
    its backtrace included): (row, column) pairs."""
    n, m = x.shape
    inf = math.inf
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    trace = [[-1] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    values = (-x.astype(np.float32)).tolist()
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1][j - 1], cost[i - 1][j], cost[i][j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i][j] = values[i - 1][j - 1] + c
            trace[i][j] = t
    for k in range(m + 1):
        trace[0][k] = 2
    for k in range(n + 1):
        trace[k][0] = 1
    path = []
    i, j = n, m
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i][j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return path[::-1]


def _load(path: Path) -> tuple[Any, dict[str, Any]]:
    """transformers' Whisper model of a CTranslate2 or transformers directory, and the
    directory's `config.json` (CTranslate2's holds the suppression lists and alignment heads)."""
    from transformers import WhisperForConditionalGeneration

    kind = model_format(path)  # EngineError naming the file of a directory that is no Whisper model
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if kind == "transformers":
        return WhisperForConditionalGeneration.from_pretrained(str(path), torch_dtype="float32"), config
    variables = read_ctranslate2(path / "model.bin")
    state = state_dict_from_ctranslate2(variables)
    heads = int(variables["decoder/num_heads"]) if "decoder/num_heads" in variables else \
        state["model.decoder.embed_tokens.weight"].shape[1] // 64
    model = WhisperForConditionalGeneration(whisper_config(state, heads))
    model.load_state_dict(state, strict=True)
    return model, config


def _token_ids(path: Path) -> Any:
    """A token's id by its text: the directory's `tokenizer.json`, else CTranslate2's
    `vocabulary.json` or `vocabulary.txt` (a token per line, its id its index), else the
    embedded model's tokenizer (English Whisper's vocabulary)."""
    from tokenizers import Tokenizer

    if (path / "tokenizer.json").exists():
        return Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id
    tokens: list[str] = []
    if (path / "vocabulary.json").exists():
        tokens = json.loads((path / "vocabulary.json").read_text())
    elif (path / "vocabulary.txt").exists():
        tokens = (path / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
    if tokens:
        index = {token: i for i, token in enumerate(tokens)}
        return index.get
    return Tokenizer.from_file(str(embedded_model_dir() / "tokenizer.json")).token_to_id


def _special_tokens(path: Path, config: dict[str, Any], model_config: Any) -> _Tokens:
    """The special tokens (`_token_ids`), the suppression lists (CTranslate2's config, else
    transformers' generation config, else the embedded model's) and the alignment heads (either
    config, else the decoder's last half of layers, every head)."""
    ids = _token_ids(path)
    no_speech = ids("<|nospeech|>")
    if no_speech is None:
        no_speech = ids("<|nocaptions|>")
    generation: dict[str, Any] = {}
    if (path / "generation_config.json").exists():
        generation = json.loads((path / "generation_config.json").read_text())
    suppress = config.get("suppress_ids") or generation.get("suppress_tokens")
    begin = config.get("suppress_ids_begin") or generation.get("begin_suppress_tokens")
    if not suppress or not begin:  # the embedded tiny.en's lists (English Whisper's)
        embedded = json.loads((embedded_model_dir() / "config.json").read_text())
        suppress, begin = suppress or embedded["suppress_ids"], begin or embedded["suppress_ids_begin"]
    heads = config.get("alignment_heads") or generation.get("alignment_heads")
    layers = model_config.decoder_layers
    if not heads:
        heads = [(i, h) for i in range(layers // 2, layers) for h in range(model_config.decoder_attention_heads)]
    vocab = model_config.vocab_size
    languages = [(token, text) for text, token in language_tokens(ids).values()] if vocab >= 51865 else []
    return _Tokens(ids("<|startoftranscript|>"), ids("<|notimestamps|>"), ids("<|endoftext|>"), no_speech,
                   [t for t in suppress if 0 <= t < vocab], [t for t in begin if 0 <= t < vocab],
                   [(int(a), int(b)) for a, b in heads], [t for t, _ in languages], [x for _, x in languages])
