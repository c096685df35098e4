"""LM engine: a transformers causal LM with a static KV cache, one slot per session, batched decode.

The cache is allocated once at `load()`: per layer, K and V of shape
[slots + 1, kv_heads, context, head_dim] (the extra row is a scratch row that
padding rows write into, so padding never touches a session's slot). A session
`acquire()`s a slot, `prefill()`s its prompt into it (a later prefill appends,
so a kept conversation is extended, not recomputed), and is then decoded
together with every other generating session: `decode({slot: token, ...})` is
ONE forward pass whose batch is padded up to the next size in `batch_sizes`
(the fixed shapes a GPU build captures as CUDA graphs, docs/architecture.md#cuda-graph-runner).

Per-row positions. transformers' `StaticCache` advances one shared position
for the whole batch, but sessions have different lengths. Each forward gets a
`write` function that knows which cache rows the batch rows map to and where
each row writes: a decode scatters row b's new K/V into
`keys[rows[b], :, pos[b]]` and returns K/V over positions [0, L),
L = max(pos) + 1; a prefill writes `keys[slot, :, s:s+n]`.
The model gets `position_ids` [B, q] (RoPE per row) and an explicit 4D
additive mask [B, 1, q, L] that hides, per row, everything after that row's
own position (stale entries of a slot's previous occupant and the tails of
shorter rows alike). transformers 5.24's `create_causal_mask` returns a 4D
mask as given (before consulting the cache), and both eager and SDPA
attention add a float mask to the scores, so no mask sizing by the cache is
needed; `_SlotLayer.get_seq_length`/`get_mask_sizes` raise, so a model that
did consult them would fail loudly instead of silently misplacing tokens.

Two forwards. Llama-family models (Llama, Mistral, Qwen2, incl. the embedded
SmolLM2) run through `CompactLlama` (engines/lm/llama.py): the same arithmetic
with fused projections and far fewer Python-level ops, calling `write` per
layer itself. Every other model runs through transformers' own forward with
`_SlotCache`, a `Cache` whose layers call `write` from `update()`.
`quantize="int8"` (the CPU default of the server) runs the linear layers as
per-row int8 matrix multiplies (engines/lm/quant.py).

Batch invariance. A session's logits should not depend on who shares its
decode step. Attention is the one place where they can: a reduction over L
positions sums in an order that depends on L, and L is set by the longest row
of the batch. In float32 that is rounding noise,
but int8 activation rounding amplifies it: a value that lands near a rounding
boundary flips a whole quantisation step, which then changes greedy tokens. So in the compact forward a decode row attends over
its own length rounded up to ATTENTION_SPAN positions, rows of equal span in
one attention call: a row then sums the same terms in the same order alone or
in any batch, and with int8 linear layers (exact integer matmuls, per-row
scales) batched decode is bit-identical to one-by-one decode (tested).

Memory traffic. A prefill returns a view of its slot's row (no copy). A
decode gathers the batch's rows with one `index_select` over [0, L) only
(L is the longest active conversation, usually a few hundred positions, not
`context`): that copy reads the same bytes attention reads anyway, so it at
most doubles attention's share of the step, and it keeps slot ownership
free-form. The alternative, keeping the batch rows contiguous so they are
views, would need slot compaction (whole-row copies) whenever the set of
generating sessions changes, which in a realtime server is most steps.

CUDA graphs (docs/architecture.md#cuda-graph-runner). With `static_decode` (on by default when the cache is
on CUDA, the compact forward runs and graphs are not disabled) a decode step
has static shapes: L is fixed at `context` (the mask hides the rest, and every
row sums over the same positions, so it stays batch invariant), the inputs
are three tensors (tokens, positions, cache rows) and the mask is built from
the positions inside the step. `warmup()` captures that step once per padded
batch size through the engine's `GraphRunner` (warm-up captures, outside
`max_graphs`); a decode copies its inputs into the graph's static buffers and
replays. Everything else (prefill, the CPU, the transformers forward) runs
eagerly, counted `ineligible` by the runner.

Sliding-window attention is not supported (load refuses a window shorter
than `context`). Forward passes are serialised by one lock and slot
bookkeeping by another, so `acquire`/`release` never wait for a forward.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rtmedia.engines.base import EngineError
from rtmedia.engines.graphs import GraphConfig, GraphRunner
from rtmedia.engines.lm.llama import CompactLlama, unsupported
from rtmedia.engines.lm.quant import quantize_linears
from transformers.cache_utils import Cache, CacheLayerMixin

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# A decode row attends over its own length rounded up to this (see "Batch invariance").
ATTENTION_SPAN = 64


@dataclass(frozen=True, slots=True)
class LmPrefill:
    """Append `token_ids` to `slot`; the result is the last position's logits [vocab]."""

    slot: int
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class LmDecode:
    """One token per slot, one forward pass; the result maps slot -> next-token logits [vocab]."""

    tokens: dict[int, int]


class _SlotLayer(CacheLayerMixin):
    """One layer's K/V rows; where a forward writes/reads is set on the owning cache."""

    is_sliding = False

    def __init__(self, owner: _SlotCache, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.owner = owner
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Never lazy: the tensors are allocated by the engine."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.write(self.keys, self.values, key_states, value_states)

    def get_seq_length(self) -> int:
        raise NotImplementedError("slot cache lengths are per row; pass position_ids and a 4D mask")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("slot cache lengths are per row; pass a 4D attention mask")

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _SlotCache(Cache):
    """All layers' K/V rows; `write` (set per forward by the engine) stores new K/V and returns what to attend."""

    def __init__(self, shape: tuple[int, int, int, int], n_layers: int, dtype: torch.dtype, device: Any):
        self.write: Any = None
        super().__init__(layers=[_SlotLayer(self, shape, dtype, device) for _ in range(n_layers)])

    @property
    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.layers]


def _prefill_writer(slot: int, start: int) -> Any:
    """One slot appends q tokens at [start, start + q) and attends over a view of [0, start + q)."""

    def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]
        keys[slot, :, start:end] = k[0]
        values[slot, :, start:end] = v[0]
        return keys[slot : slot + 1, :, :end], values[slot : slot + 1, :, :end]

    return write


def _decode_writer(rows: torch.Tensor, pos: torch.Tensor, kv_len: int) -> Any:
    """Batch row b writes one token at its own position of cache row rows[b], then reads [0, kv_len)."""

    def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        keys[rows, :, pos] = k[:, :, 0]
        values[rows, :, pos] = v[:, :, 0]
        return keys[:, :, :kv_len].index_select(0, rows), values[:, :, :kv_len].index_select(0, rows)

    return write


class LmEngine:
    """A causal LM over a static slot cache; see the module docstring.

    Give `model_dir` (loaded with `AutoModelForCausalLM`, plus `AutoTokenizer` when the directory has
    tokenizer files) or an already built `model` (its device and dtype are used as they are). A loaded
    model is moved to `device` when one is given (default: it stays on the CPU). The cache
    lives on the model's device. `threads`, if set, is applied with `torch.set_num_threads` (process-wide).
    """

    name = "lm"

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model: Any = None,
        slots: int = 16,
        context: int = 2048,
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
        dtype: torch.dtype = torch.float32,
        threads: int | None = None,
        compact: bool = True,
        quantize: str | None = None,
        graphs: GraphRunner | GraphConfig | None = None,
        static_decode: bool | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if (model_dir is None) == (model is None):
            raise ValueError("give exactly one of model_dir and model")
        if slots < 1 or context < 2 or not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"need slots, batch sizes >= 1 and context >= 2; got {slots}, {batch_sizes}, {context}")
        if quantize not in (None, "int8"):
            raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
        self.model_dir = None if model_dir is None else Path(model_dir)
        self._given = model  # a caller's model is reused by a load() after close()
        self.model: Any = None
        self.tokenizer: Any = None
        self.context, self.dtype, self._threads = context, dtype, threads
        self.device = None if device is None else torch.device(device)  # where a model_dir model goes
        self._want_compact, self.quantize = compact, quantize
        self.compact: CompactLlama | None = None
        self.compact_refused: str | None = None  # why the transformers forward is used, when it is
        self._slots = slots
        # Padded batch sizes: the configured ones capped at `slots`, plus `slots` so any batch fits.
        self.batch_sizes = tuple(sorted({min(b, slots) for b in batch_sizes} | {slots}))
        self._lock = threading.Lock()  # slot bookkeeping
        self._run = threading.Lock()  # forward passes
        self._free = list(range(slots))
        self._length = [0] * slots
        self._epoch = [0] * slots  # bumped by release: a forward in flight must not touch the next occupant
        self._held = [False] * slots
        self._cache: _SlotCache | None = None
        # CUDA graphs of the decode step (module docstring); None: decide at load.
        self.graphs = graphs if isinstance(graphs, GraphRunner) else GraphRunner(self.name, graphs)
        self._want_static = static_decode
        self.static_decode = False
        self._positions: torch.Tensor | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    @torch.inference_mode()
    def load(self) -> None:
        with self._run:
            if self._cache is not None:
                return
            if self._threads:
                torch.set_num_threads(self._threads)
            self.model = self._given
            if self.model is None:
                from transformers import AutoModelForCausalLM, AutoTokenizer
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()  # no progress bars in server logs

                assert self.model_dir is not None
                self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
                if self.device is not None:
                    self.model.to(self.device)
                if any((self.model_dir / f).exists() for f in _TOKENIZER_FILES):
                    self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self.model.eval().requires_grad_(False)
            cfg = self.model.config
            window = getattr(cfg, "sliding_window", None)
            if window is not None and window < self.context:
                raise EngineError(f"sliding-window attention ({window}) is unsupported; use context <= {window}")
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            param = next(self.model.parameters())
            shape = (self._slots + 1, kv_heads, self.context, head_dim)
            self._cache = _SlotCache(shape, cfg.num_hidden_layers, param.dtype, param.device)
            if self.quantize is not None and param.device.type != "cpu":
                raise EngineError(f"quantize={self.quantize} is the CPU path; the model is on {param.device}")
            self.compact_refused = unsupported(self.model) if self._want_compact else "compact forward disabled"
            if self.compact_refused is None:
                self.compact = CompactLlama(self.model, self.context, self.quantize)
            elif self.quantize == "int8":
                quantize_linears(self.model)  # the transformers forward on int8 linears
            self._positions = torch.arange(self.context, device=param.device)
            graphable = self.compact is not None and self.graphs.eligible([self._positions])
            self.static_decode = graphable if self._want_static is None else self._want_static

    def warmup(self) -> None:
        """One prefill and one decode per padded batch size, on a scratch slot that is then freed."""
        self.load()
        slot = self.acquire()
        if slot is None:
            return
        try:
            n = max(1, min(8, self.context - len(self.batch_sizes)))
            self.prefill(slot, [0] * n)
            if self.static_decode:
                self._capture_decode_graphs()
            for size in self.batch_sizes:
                if self.length(slot) < self.context:
                    self._decode({slot: 0}, size)
        finally:
            self.release(slot)

    def _capture_decode_graphs(self) -> None:
        """One warm-up capture of the static decode step per padded batch size (scratch row only)."""
        device = self._positions.device
        with self._run, torch.inference_mode():
            for size in self.batch_sizes:
                rows = torch.full((size,), self._slots, device=device)
                zeros = torch.zeros(size, dtype=torch.long, device=device)
                self.graphs.capture(self._static_step, zeros[:, None], zeros, rows, tag="decode")

    def close(self) -> None:
        with self._run, self._lock:
            self.graphs.reset()
            self._cache = self.compact = None
            self.model = self.tokenizer = None
            self._free = list(range(self._slots))
            self._length = [0] * self._slots
            self._held = [False] * self._slots

    # -- slots -----------------------------------------------------------------------------------

    @property
    def slots_total(self) -> int:
        return self._slots

    @property
    def slots_free(self) -> int:
        with self._lock:
            return len(self._free)

    def acquire(self) -> int | None:
        """The lowest free slot (length 0), or None when all are taken."""
        with self._lock:
            if not self._free:
                return None
            slot = min(self._free)
            self._free.remove(slot)
            self._held[slot] = True
            self._length[slot] = 0
            return slot

    def release(self, slot: int) -> None:
        """Give the slot back; its length goes to 0. Releasing a free slot does nothing."""
        with self._lock:
            if 0 <= slot < self._slots and self._held[slot]:
                self._held[slot] = False
                self._length[slot] = 0
                self._epoch[slot] += 1
                self._free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the slot's first `length` tokens (a kept conversation that diverges there)."""
        with self._lock:
            if not (0 <= slot < self._slots and self._held[slot]):
                raise EngineError(f"slot {slot} is not acquired")
            self._length[slot] = max(0, min(length, self._length[slot]))

    def length(self, slot: int) -> int:
        """Tokens the slot holds (0 when free)."""
        if not 0 <= slot < self._slots:
            raise EngineError(f"no slot {slot}; the engine has {self._slots}")
        with self._lock:
            return self._length[slot]

    def padded_size(self, n: int) -> int:
        """The batch size a decode of `n` slots runs at."""
        return next(b for b in self.batch_sizes if b >= n)

    # -- compute ---------------------------------------------------------------------------------

    def step(self, items: Sequence[LmPrefill | LmDecode]) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if isinstance(item, LmPrefill):
                out.append(self.prefill(item.slot, item.token_ids))
            elif isinstance(item, LmDecode):
                out.append(self.decode(item.tokens))
            else:
                raise ValueError(f"LM items must be LmPrefill or LmDecode, got {type(item).__name__}")
        return out

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Append the tokens to the slot; the last position's logits [vocab] (float32)."""
        n = len(token_ids)
        if n == 0:
            raise EngineError(f"prefill of slot {slot} with no tokens")
        with self._run:
            cache = self._loaded()
            (start,), (epoch,) = self._claim([slot], extra=n)
            device = cache.layers[0].keys.device
            q = torch.arange(start, start + n, device=device)
            mask = self._mask(q[None, :, None] >= torch.arange(start + n, device=device))  # [1, n, start+n]
            tokens = torch.tensor([list(token_ids)], device=device)
            logits = self._forward(cache, tokens, q[None], mask, _prefill_writer(slot, start))
            self._commit([slot], [epoch], n)
            return logits[0]

    @torch.inference_mode()
    def prefill_many(self, items: Mapping[int, Sequence[int]]) -> dict[int, torch.Tensor]:
        """Append each slot's tokens in ONE forward pass; the last position's logits per slot.

        Rows are left-padded to the longest: a padding query is never written to the cache and
        no real query attends to it, so each row's logits are those of its own prefill."""
        if len(items) == 1:
            ((slot, ids),) = items.items()
            return {slot: self.prefill(slot, ids)}
        if any(not ids for ids in items.values()):
            raise EngineError("prefill of a slot with no tokens")
        slots = list(items)
        with self._run:
            cache = self._loaded()
            claims = [self._claim([s], extra=len(items[s])) for s in slots]
            starts, epochs = [c[0][0] for c in claims], [c[1][0] for c in claims]
            sizes = [len(items[s]) for s in slots]
            q, kv_len = max(sizes), max(a + n for a, n in zip(starts, sizes, strict=True))
            device = cache.layers[0].keys.device
            pads = [q - n for n in sizes]
            pos = torch.tensor([[a + max(0, j - pad) for j in range(q)] for a, pad in zip(starts, pads, strict=True)],
                               device=device)
            tokens = torch.tensor([[0] * pad + list(items[s]) for s, pad in zip(slots, pads, strict=True)],
                                  device=device)
            mask = self._mask(pos[:, :, None] >= torch.arange(kv_len, device=device))
            rows = torch.tensor(slots, device=device)

            def write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
                for b, (slot, start, n) in enumerate(zip(slots, starts, sizes, strict=True)):
                    keys[slot, :, start:start + n] = k[b, :, q - n:]
                    values[slot, :, start:start + n] = v[b, :, q - n:]
                return keys[:, :, :kv_len].index_select(0, rows), values[:, :, :kv_len].index_select(0, rows)

            logits = self._forward(cache, tokens, pos, mask, write)
            for slot, epoch, n in zip(slots, epochs, sizes, strict=True):
                self._commit([slot], [epoch], n)
            return {s: logits[i] for i, s in enumerate(slots)}

    def decode(self, tokens: Mapping[int, int]) -> dict[int, torch.Tensor]:
        """One forward pass for all given slots (each at its own position); next-token logits per slot."""
        if not tokens:
            return {}
        if len(tokens) > self._slots:
            raise EngineError(f"decode of {len(tokens)} slots, engine has {self._slots}")
        return self._decode(tokens, self.padded_size(len(tokens)))

    @torch.inference_mode()
    def _decode(self, tokens: Mapping[int, int], size: int) -> dict[int, torch.Tensor]:
        slots = list(tokens)
        with self._run:
            cache = self._loaded()
            starts, epochs = self._claim(slots, extra=1)
            pad = size - len(slots)
            device = cache.layers[0].keys.device
            rows = torch.tensor(slots + [self._slots] * pad, device=device)  # padding -> scratch row
            pos = torch.tensor(starts + [0] * pad, device=device)
            tokens_in = torch.tensor([tokens[s] for s in slots] + [0] * pad, device=device)[:, None]
            if self.static_decode:
                logits = self.graphs.run(self._static_step, tokens_in, pos, rows, tag="decode")
            else:
                spans = [self._span(p) for p in [*starts, *[0] * pad]]
                kv_len = max(spans)
                mask = self._mask(pos[:, None, None] >= torch.arange(kv_len, device=device))
                groups = [(torch.tensor([i for i, n in enumerate(spans) if n == span], device=device), span)
                          for span in sorted(set(spans))]
                logits = self.graphs.eager(
                    lambda t, p, r: self._forward(cache, t, p[:, None], mask, _decode_writer(r, p, kv_len), groups),
                    tokens_in, pos, rows)
            self._commit(slots, epochs, 1)
            return {s: logits[i] for i, s in enumerate(slots)}

    def _static_step(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The decode step with static shapes (what a CUDA graph captures): every row attends over
        the whole context under its mask. tokens [B, 1], pos and rows [B]."""
        assert self._cache is not None and self._positions is not None
        mask = self._mask(pos[:, None, None] >= self._positions)
        return self._forward(self._cache, tokens, pos[:, None], mask, _decode_writer(rows, pos, self.context))

    def _span(self, position: int) -> int:
        """Positions a decode row at `position` attends over: its length rounded up to ATTENTION_SPAN."""
        return min(self.context, -(-(position + 1) // ATTENTION_SPAN) * ATTENTION_SPAN)

    def _forward(self, cache: _SlotCache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 write: Any, groups: list[tuple[torch.Tensor, int]] | None = None) -> torch.Tensor:
        """Float32 logits [B, vocab] of each row's last position, through the compact or the transformers
        forward; `write` places the new K/V in the cache (see _prefill_writer/_decode_writer)."""
        if self.compact is not None:
            return self.compact.forward(tokens, positions, mask, cache.tensors, write, groups)
        cache.write = write
        try:
            out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache,
                             use_cache=True, logits_to_keep=1)
        finally:
            cache.write = None
        return out.logits[:, -1].float()

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """Additive float mask [B, 1, q, L] from a boolean [B, q, L] (True = attend)."""
        dtype = self.model.dtype
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        return torch.where(visible, zero, torch.finfo(dtype).min)[:, None]

    def _claim(self, slots: Sequence[int], extra: int) -> tuple[list[int], list[int]]:
        """Current lengths and epochs of held slots that have room for `extra` more tokens."""
        with self._lock:
            for s in slots:
                if not (0 <= s < self._slots and self._held[s]):
                    raise EngineError(f"slot {s} is not acquired")
                if self._length[s] + extra > self.context:
                    raise EngineError(
                        f"slot {s} holds {self._length[s]} tokens; {extra} more exceed the context of {self.context}"
                    )
            return [self._length[s] for s in slots], [self._epoch[s] for s in slots]

    def _commit(self, slots: Sequence[int], epochs: Sequence[int], n: int) -> None:
        with self._lock:
            for s, e in zip(slots, epochs, strict=True):
                if self._epoch[s] == e:  # not released meanwhile
                    self._length[s] += n

    def _loaded(self) -> _SlotCache:
        if self._cache is None:
            raise EngineError("LM engine is not loaded")
        return self._cache


class EmbeddedLmEngine(LmEngine):
    """The embedded SmolLM2-135M-Instruct. Its directory is the wheel's GGUF file
    converted once to safetensors and cached (engines/lm/models.py); `load()`
    finds or makes it, so the conversion runs off the event loop like all loading."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("<embedded SmolLM2-135M-Instruct>", **kwargs)

    def load(self) -> None:
        from rtmedia.engines.lm.models import embedded_model_dir

        if self._cache is None:
            self.model_dir = embedded_model_dir()
        super().load()
