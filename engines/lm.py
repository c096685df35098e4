"""LM engine: a transformers causal LM with a static KV cache, one slot per session, batched decode.

The cache is allocated once at `load()`: per layer, K and V of shape
[slots + 1, kv_heads, context, head_dim] (the extra row is a scratch row that
padding rows write into, so padding never touches a session's slot). A session
`acquire()`s a slot, `prefill()`s its prompt into it (a later prefill appends,
so a kept conversation is extended, not recomputed), and is then decoded
together with every other generating session: `decode({slot: token, ...})` is
ONE forward pass whose batch is padded up to the next size in `batch_sizes`
(the fixed shapes a GPU build captures as CUDA graphs, SPEC §4).

Per-row positions. transformers' `StaticCache` advances one shared position
for the whole batch, but sessions have different lengths. `_SlotCache` is a
`Cache` whose layers (`_SlotLayer`) are told, before each forward, which cache
rows the batch rows map to and where each row writes: on `update()` a decode
scatters row b's new K/V into `keys[rows[b], :, pos[b]]` and returns K/V over
positions [0, L), L = max(pos) + 1; a prefill writes `keys[slot, :, s:s+n]`.
The model gets `position_ids` [B, q] (RoPE per row) and an explicit 4D
additive mask [B, 1, q, L] that hides, per row, everything after that row's
own position (stale entries of a slot's previous occupant and the tails of
shorter rows alike). transformers 5.24's `create_causal_mask` returns a 4D
mask as given (before consulting the cache), and both eager and SDPA
attention add a float mask to the scores, so no mask sizing by the cache is
needed; `_SlotLayer.get_seq_length`/`get_mask_sizes` raise, so a model that
did consult them would fail loudly instead of silently misplacing tokens.

Memory traffic. A prefill returns a view of its slot's row (no copy). A
decode gathers the batch's rows with one `index_select` over [0, L) only
(L is the longest active conversation, usually a few hundred positions, not
`context`): that copy reads the same bytes attention reads anyway, so it at
most doubles attention's share of the step, and it keeps slot ownership
free-form. The alternative, keeping the batch rows contiguous so they are
views, would need slot compaction (whole-row copies) whenever the set of
generating sessions changes, which in a realtime server is most steps. A CUDA
graph build would fix L (e.g. at `context`, the mask does the rest).

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
from transformers.cache_utils import Cache, CacheLayerMixin

from .base import EngineError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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
        o = self.owner
        if o.row is not None:  # prefill of one slot: write [start, start+n), return a view of [0, end)
            end = o.start + key_states.shape[2]
            self.keys[o.row, :, o.start : end] = key_states[0]
            self.values[o.row, :, o.start : end] = value_states[0]
            return self.keys[o.row : o.row + 1, :, :end], self.values[o.row : o.row + 1, :, :end]
        # decode: batch row b writes at its own position, then reads its slot's positions [0, L)
        self.keys[o.rows, :, o.pos] = key_states[:, :, 0]
        self.values[o.rows, :, o.pos] = value_states[:, :, 0]
        keys = self.keys[:, :, : o.kv_len].index_select(0, o.rows)
        return keys, self.values[:, :, : o.kv_len].index_select(0, o.rows)

    def get_seq_length(self) -> int:
        raise NotImplementedError("slot cache lengths are per row; pass position_ids and a 4D mask")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("slot cache lengths are per row; pass a 4D attention mask")

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _SlotCache(Cache):
    """All layers' K/V rows plus the current forward's row mapping (see module docstring)."""

    def __init__(self, shape: tuple[int, int, int, int], n_layers: int, dtype: torch.dtype, device: Any):
        self.row: int | None = None  # prefill: the slot, and where its new tokens start
        self.start = 0
        self.rows = self.pos = torch.zeros(0, dtype=torch.long)  # decode: cache row, position per batch row
        self.kv_len = 0  # decode: L
        super().__init__(layers=[_SlotLayer(self, shape, dtype, device) for _ in range(n_layers)])


class LmEngine:
    """A causal LM over a static slot cache; see the module docstring.

    Give `model_dir` (loaded with `AutoModelForCausalLM`, plus `AutoTokenizer` when the directory has
    tokenizer files) or an already built `model` (its device and dtype are used as they are). The cache
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
    ) -> None:
        if (model_dir is None) == (model is None):
            raise ValueError("give exactly one of model_dir and model")
        if slots < 1 or context < 2 or not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"need slots, batch sizes >= 1 and context >= 2; got {slots}, {batch_sizes}, {context}")
        self.model_dir = None if model_dir is None else Path(model_dir)
        self._given = model  # a caller's model is reused by a load() after close()
        self.model: Any = None
        self.tokenizer: Any = None
        self.context, self.dtype, self._threads = context, dtype, threads
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

    def warmup(self) -> None:
        """One prefill and one decode per padded batch size, on a scratch slot that is then freed."""
        self.load()
        slot = self.acquire()
        if slot is None:
            return
        try:
            n = max(1, min(8, self.context - len(self.batch_sizes)))
            self.prefill(slot, [0] * n)
            for size in self.batch_sizes:
                if self.length(slot) < self.context:
                    self._decode({slot: 0}, size)
        finally:
            self.release(slot)

    def close(self) -> None:
        with self._run, self._lock:
            self._cache = None
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
            cache.row, cache.start = slot, start
            try:
                logits = self.model(
                    input_ids=torch.tensor([list(token_ids)], device=device),
                    position_ids=q[None],
                    attention_mask=mask,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits
            finally:
                cache.row = None
            self._commit([slot], [epoch], n)
            return logits[0, -1].float()

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
            cache.rows = torch.tensor(slots + [self._slots] * pad, device=device)  # padding -> scratch row
            cache.pos = torch.tensor(starts + [0] * pad, device=device)
            cache.kv_len = max(starts) + 1
            mask = self._mask(cache.pos[:, None, None] >= torch.arange(cache.kv_len, device=device))
            logits = self.model(
                input_ids=torch.tensor([tokens[s] for s in slots] + [0] * pad, device=device)[:, None],
                position_ids=cache.pos[:, None],
                attention_mask=mask,
                cache=cache,
                use_cache=True,
            ).logits
            self._commit(slots, epochs, 1)
            return {s: logits[i, -1].float() for i, s in enumerate(slots)}

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
    converted once to safetensors and cached (engines/lm_models.py); `load()`
    finds or makes it, so the conversion runs off the event loop like all loading."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("<embedded SmolLM2-135M-Instruct>", **kwargs)

    def load(self) -> None:
        from rtmedia.engines.lm_models import embedded_model_dir

        if self._cache is None:
            self.model_dir = embedded_model_dir()
        super().load()
