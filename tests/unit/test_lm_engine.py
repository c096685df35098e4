"""LM engine: batched decode over the slot cache equals one-by-one decode and the plain model on the full
sequence, through the compact Llama-family forward and through transformers' own; sessions join and leave;
padding, slot bookkeeping, context limits, prefill extension, truncation; other architectures; int8 linear
layers keep batched decode bit-identical to one-by-one; batched decode costs less per token than one-by-one;
a batched prefill over several slots equals one prefill per slot.

Models are tiny random-weight configs saved locally and loaded through `from_pretrained`; nothing is
downloaded."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from rtmedia.engines.base import EngineError
from rtmedia.engines.lm.engine import LmDecode, LmEngine, LmPrefill
from rtmedia.engines.lm.quant import Int8Linear
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.support.throughput import best_of, decode_cpu_per_token, decoding_slots

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
ATOL = 1e-4
STEPS = 6


def _save(path: Path, config_cls: type, model_cls: type, **extra: object) -> Path:
    torch.manual_seed(0)
    model_cls(config_cls(**TINY, **extra)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM)


EngineFactory = Callable[..., LmEngine]


@pytest.fixture(params=["compact", "transformers"])
def make_engine(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[EngineFactory]:
    """Engines with the compact forward (Llama family) or with transformers' forward."""
    engines: list[LmEngine] = []

    def make(path: Path = model_dir, **kw: object) -> LmEngine:
        kw = {"slots": 6, "context": 64, "compact": request.param == "compact", **kw}
        eng = LmEngine(path, **kw)  # type: ignore[arg-type]
        eng.load()
        eng.warmup()
        assert (eng.compact is not None) == (request.param == "compact"), eng.compact_refused
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, TINY["vocab_size"], (n,), generator=g).tolist()


@torch.inference_mode()
def reference(eng: LmEngine, ids: list[int]) -> torch.Tensor:
    """Last-position logits of the plain HF model on the whole sequence, no cache."""
    return eng.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = (a - b).abs().max().item()
    assert err <= ATOL, f"{what}: max |diff| {err:.2e} > {ATOL}"


def assert_same_greedy(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    top = torch.topk(a, 2).values
    if top[0] - top[1] > 1e-3:
        assert int(a.argmax()) == int(b.argmax()), what


class Sessions:
    """Drives an engine greedily and checks every logits vector against the full-sequence reference."""

    def __init__(self, eng: LmEngine) -> None:
        self.eng = eng
        self.seq: dict[int, list[int]] = {}
        self.next: dict[int, int] = {}

    def join(self, prompt: list[int]) -> int:
        slot = self.eng.acquire()
        assert slot is not None
        logits = self.eng.prefill(slot, prompt)
        assert logits.shape == (TINY["vocab_size"],) and logits.dtype == torch.float32
        assert_close(logits, reference(self.eng, prompt), f"prefill slot {slot}")
        self.seq[slot], self.next[slot] = list(prompt), int(logits.argmax())
        return slot

    def leave(self, slot: int) -> None:
        self.eng.release(slot)
        del self.seq[slot], self.next[slot]
        assert self.eng.length(slot) == 0

    def step(self) -> dict[int, torch.Tensor]:
        out = self.eng.decode(dict(self.next))
        assert set(out) == set(self.next)
        for slot, logits in out.items():
            self.seq[slot].append(self.next[slot])
            assert_close(logits, reference(self.eng, self.seq[slot]), f"decode slot {slot}")
            assert self.eng.length(slot) == len(self.seq[slot])
            self.next[slot] = int(logits.argmax())
        return out


def test_batched_decode_equals_one_by_one_and_full_model(make_engine: EngineFactory) -> None:
    prompts = [_prompt(n, seed) for seed, n in enumerate((3, 9, 1, 17, 6))]
    batched = Sessions(make_engine())
    slots = [batched.join(p) for p in prompts]
    steps = [batched.step() for _ in range(STEPS)]

    solo = make_engine()
    for slot, prompt in zip(slots, prompts, strict=True):
        own = solo.acquire()
        assert own is not None
        solo.prefill(own, prompt)
        for k in range(STEPS):
            token = batched.seq[slot][len(prompt) + k]
            alone = solo.decode({own: token})[own]
            assert_close(alone, steps[k][slot], f"slot {slot} step {k}: batched vs alone")
            assert_same_greedy(alone, steps[k][slot], f"slot {slot} step {k}: greedy token")
            full = reference(solo, batched.seq[slot][: len(prompt) + k + 1])
            assert_close(alone, full, f"slot {slot} step {k}: alone vs full model")
        solo.release(own)


def test_sessions_join_and_leave_mid_batch(make_engine: EngineFactory) -> None:
    s = Sessions(make_engine(slots=4))
    a, b, c = (s.join(_prompt(n, 10 + n)) for n in (5, 21, 2))
    for _ in range(3):
        s.step()
    s.leave(b)  # b held 24 tokens; its successor holds fewer, the stale tail must stay invisible
    d = s.join(_prompt(4, 99))
    assert d == b
    for _ in range(3):
        s.step()
    s.leave(a)
    s.leave(c)
    e = s.join(_prompt(7, 7))
    for _ in range(3):
        s.step()
    assert s.eng.slots_free == 2 and sorted(s.seq) == sorted([d, e])


def test_padded_batch_sizes_give_the_same_results(make_engine: EngineFactory) -> None:
    """3 decoding slots run unpadded, padded to 4 and to 6; 2 idle slots are untouched by padding rows."""
    results = []
    for size in (3, 4, 6):
        eng = make_engine(batch_sizes=(size,))
        assert eng.padded_size(3) == size
        s = Sessions(eng)
        active = [s.join(_prompt(n, n)) for n in (4, 11, 2)]
        idle = [s.join(_prompt(n, n)) for n in (6, 3)]
        nxt = {k: s.next.pop(k) for k in idle}
        results.append([s.step() for _ in range(3)])
        s.next = nxt  # now decode the idle slots: their caches must be intact
        s.step()
        assert all(s.eng.length(k) == len(s.seq[k]) for k in active)
    for other in results[1:]:
        for step0, step1 in zip(results[0], other, strict=True):
            for slot in step0:
                assert_close(step0[slot], step1[slot], f"slot {slot}: padding changed the result")


def test_padded_size_choice(model_dir: Path) -> None:
    eng = LmEngine(model_dir, slots=16)
    assert eng.batch_sizes == (1, 2, 4, 8, 16)
    assert [eng.padded_size(n) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert LmEngine(model_dir, slots=3).padded_size(3) == 3
    assert LmEngine(model_dir, slots=20, batch_sizes=(8, 32)).padded_size(17) == 20


def test_acquire_release(make_engine: EngineFactory) -> None:
    eng = make_engine(slots=3)
    assert eng.slots_total == 3 and eng.slots_free == 3
    assert [eng.acquire() for _ in range(3)] == [0, 1, 2]
    assert eng.acquire() is None and eng.slots_free == 0
    eng.prefill(1, [5, 6, 7])
    assert eng.length(1) == 3
    eng.release(1)
    eng.release(1)  # idempotent
    assert eng.slots_free == 1 and eng.length(1) == 0
    assert eng.acquire() == 1
    assert eng.acquire() is None
    with pytest.raises(EngineError, match="slot 5 is not acquired"):
        eng.decode({5: 1})


def test_context_overflow_raises(make_engine: EngineFactory) -> None:
    eng = make_engine(slots=2, context=16)
    a, b = eng.acquire(), eng.acquire()
    assert a is not None and b is not None
    with pytest.raises(EngineError, match=rf"slot {a} holds 0 tokens; 17 more exceed the context of 16"):
        eng.prefill(a, _prompt(17, 1))
    eng.prefill(a, _prompt(10, 1))
    with pytest.raises(EngineError, match=rf"slot {a} holds 10 tokens; 7 more"):
        eng.prefill(a, _prompt(7, 2))
    eng.prefill(a, _prompt(6, 2))  # exactly full
    eng.prefill(b, [1])
    with pytest.raises(EngineError, match=rf"slot {a} holds 16 tokens; 1 more"):
        eng.decode({b: 3, a: 4})
    assert eng.length(a) == 16 and eng.length(b) == 1  # nothing was appended


def test_prefill_extends_a_kept_conversation(make_engine: EngineFactory) -> None:
    eng = make_engine()
    first, second = _prompt(9, 1), _prompt(5, 2)
    a, b = eng.acquire(), eng.acquire()
    assert a is not None and b is not None
    eng.prefill(a, first)
    eng.decode({a: 42})
    extended = eng.prefill(a, second)
    whole = eng.prefill(b, [*first, 42, *second])
    assert_close(extended, whole, "prefill extension vs one prefill")
    assert eng.length(a) == eng.length(b) == len(first) + 1 + len(second)
    out = eng.decode({a: 7, b: 7})
    assert_close(out[a], out[b], "decode after extension")


def test_truncate_keeps_a_prefix(make_engine: EngineFactory) -> None:
    eng = make_engine()
    a, b = eng.acquire(), eng.acquire()
    assert a is not None and b is not None
    first = _prompt(12, 3)
    eng.prefill(a, first)
    eng.truncate(a, 7)
    assert eng.length(a) == 7
    assert_close(eng.prefill(a, [9, 8]), reference(eng, [*first[:7], 9, 8]), "prefill after truncate")
    eng.truncate(a, 100)  # never grows
    assert eng.length(a) == 9
    eng.release(b)
    with pytest.raises(EngineError, match=f"slot {b} is not acquired"):
        eng.truncate(b, 0)


def test_prefill_many_equals_one_prefill_per_slot(make_engine: EngineFactory) -> None:
    """Rows of different lengths and starts in one forward: each row's logits, and what it leaves in
    its slot, are those of its own prefill."""
    eng = make_engine()
    a, b, c = (eng.acquire() for _ in range(3))
    assert a is not None and b is not None and c is not None
    eng.prefill(a, _prompt(10, 4))  # a kept history, extended by the batch
    out = eng.prefill_many({a: _prompt(3, 5), b: _prompt(7, 6), c: [11]})
    assert_close(out[a], reference(eng, [*_prompt(10, 4), *_prompt(3, 5)]), "row a (extends a kept slot)")
    assert_close(out[b], reference(eng, _prompt(7, 6)), "row b")
    assert_close(out[c], reference(eng, [11]), "row c (one token)")
    assert [eng.length(s) for s in (a, b, c)] == [13, 7, 1]
    after = eng.decode({a: 9, b: 9})
    assert_close(after[b], reference(eng, [*_prompt(7, 6), 9]), "decode after the batch")
    with pytest.raises(EngineError, match="no tokens"):
        eng.prefill_many({a: [1], b: []})


def test_int8_batched_decode_is_bit_identical_to_one_by_one(model_dir: Path) -> None:
    """Per-row int8 activations: a row's logits do not depend on its batch-mates, and stay near float32."""
    prompts = [_prompt(n, seed) for seed, n in enumerate((3, 9, 1, 17, 6))]
    engines = [LmEngine(model_dir, slots=6, context=64, quantize="int8") for _ in range(2)]
    flt = LmEngine(model_dir, slots=6, context=64)
    for eng in (*engines, flt):
        eng.load()
    batched, solo = engines
    assert batched.compact is not None and isinstance(batched.compact.layers[0].qkv, Int8Linear)
    slots = [batched.acquire() for _ in prompts]
    nxt = {s: int(batched.prefill(s, p).argmax()) for s, p in zip(slots, prompts, strict=True)}
    seqs = {s: [*p, nxt[s]] for s, p in zip(slots, prompts, strict=True)}
    for _ in range(STEPS):
        out = batched.decode(nxt)
        for s in slots:
            own, ref = solo.acquire(), flt.acquire()
            assert own is not None and ref is not None
            solo.prefill(own, seqs[s][:-1])
            alone = solo.decode({own: seqs[s][-1]})[own]
            assert torch.equal(alone, out[s]), f"slot {s}: int8 batched vs alone"
            expected = flt.prefill(ref, seqs[s])
            spread = (expected.max() - expected.min()).item()
            assert (out[s] - expected).abs().max().item() < 0.05 * spread, f"slot {s}: int8 far from float32"
            solo.release(own)
            flt.release(ref)
        nxt = {s: int(out[s].argmax()) for s in slots}
        for s in slots:
            seqs[s].append(nxt[s])
    for eng in (*engines, flt):
        eng.close()
    with pytest.raises(ValueError, match="quantize must be None or 'int8'"):
        LmEngine(model_dir, quantize="int4")


def test_models_outside_the_compact_family_use_transformers_forward(tmp_path: Path) -> None:
    eng = LmEngine(_save(tmp_path, LlamaConfig, LlamaForCausalLM, hidden_act="gelu_pytorch_tanh"), slots=3,
                   context=64)
    eng.load()
    assert eng.compact is None and eng.compact_refused == "activation 'gelu_pytorch_tanh' is not silu"
    s = Sessions(eng)
    for n in (3, 8):
        s.join(_prompt(n, n))
    for _ in range(2):
        s.step()
    eng.close()


def test_step_protocol(make_engine: EngineFactory) -> None:
    eng = make_engine()
    p, q = _prompt(4, 1), _prompt(8, 2)
    a, b = eng.acquire(), eng.acquire()
    assert a is not None and b is not None
    lp, lq, dec = eng.step([LmPrefill(a, p), LmPrefill(b, q), LmDecode({b: 3, a: 9})])
    assert_close(lp, reference(eng, p), "step prefill a")
    assert_close(lq, reference(eng, q), "step prefill b")
    assert_close(dec[a], reference(eng, [*p, 9]), "step decode a")
    assert_close(dec[b], reference(eng, [*q, 3]), "step decode b")
    with pytest.raises(ValueError, match="LmPrefill or LmDecode"):
        eng.step([object()])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "extra"),
    [
        (Qwen2Config, Qwen2ForCausalLM, {}),
        (MistralConfig, MistralForCausalLM, {"sliding_window": 4096}),
        (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True, "attention_bias": True}),
    ],
    ids=["qwen2", "mistral", "llama-tied-bias"],
)
def test_other_architectures(
    make_engine: EngineFactory, tmp_path: Path, config_cls: type, model_cls: type, extra: dict
) -> None:
    s = Sessions(make_engine(_save(tmp_path, config_cls, model_cls, **extra)))
    for n in (2, 13, 6):
        s.join(_prompt(n, n))
    for _ in range(3):
        s.step()


def test_given_model_with_eager_attention(model_dir: Path) -> None:
    """The 4D additive mask works for eager attention too (SDPA is the default), with `model=`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    eng = LmEngine(model=model, slots=4, context=64)
    eng.load()
    s = Sessions(eng)
    for n in (3, 12, 1):
        s.join(_prompt(n, n))
    for _ in range(3):
        s.step()
    eng.close()
    eng.load()  # the given model is reused
    assert eng.model is model and eng.slots_free == 4
    eng.close()


def test_bfloat16(model_dir: Path) -> None:
    """bfloat16 weights and cache; float32 logits close to the bfloat16 model on the full sequence."""
    eng = LmEngine(model_dir, slots=3, context=64, dtype=torch.bfloat16)
    eng.load()
    assert eng.model.dtype == torch.bfloat16
    slots = [eng.acquire() for _ in range(3)]
    seqs = {}
    for slot, n in zip(slots, (2, 9, 5), strict=True):
        assert slot is not None
        seqs[slot] = _prompt(n, n)
        eng.prefill(slot, seqs[slot])
    out = eng.decode({slot: 11 for slot in seqs})
    for slot, logits in out.items():
        assert logits.dtype == torch.float32
        err = (logits - reference(eng, [*seqs[slot], 11])).abs().max().item()
        assert err < 2e-2, f"slot {slot}: bfloat16 max |diff| {err}"
    eng.close()


def test_slot_bookkeeping_is_thread_safe(model_dir: Path) -> None:
    eng = LmEngine(model_dir, slots=8, context=16)
    eng.load()
    got: list[int] = []

    def churn() -> None:
        for _ in range(200):
            slot = eng.acquire()
            if slot is not None:
                eng.release(slot)
        slot = eng.acquire()
        if slot is not None:
            got.append(slot)

    workers = [threading.Thread(target=churn) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(got) == list(range(8)) and eng.slots_free == 0
    eng.close()


def test_sliding_window_shorter_than_context_is_refused(tmp_path: Path) -> None:
    eng = LmEngine(_save(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=32), context=64)
    with pytest.raises(EngineError, match="sliding-window"):
        eng.load()


def test_lifecycle_and_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = _save(tmp_path, LlamaConfig, LlamaForCausalLM)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    eng = LmEngine(path, slots=2, context=32)
    with pytest.raises(EngineError, match="not loaded"):
        eng.decode({0: 1})
    eng.load()
    eng.load()  # idempotent
    assert eng.tokenizer is not None and eng.tokenizer("hello world")["input_ids"] == [1, 2]
    eng.warmup()
    assert eng.slots_free == 2
    eng.close()
    eng.close()
    assert eng.model is None
    plain = LmEngine(model_dir)
    plain.load()
    assert plain.tokenizer is None
    plain.close()


def test_batched_decode_of_16_sessions_costs_less_per_token_than_one_by_one(model_dir: Path) -> None:
    """What the slot cache is for: 16 sessions decoding in one batched step per token take at most
    a third of the CPU time per token of one decode call per session (about a twelfth, measured on
    one intra-op thread with the tiny model). Tokens per second by batch size and model size:
    tests/perf/bench_batching.py."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = LmEngine(model_dir, slots=16, context=128)
    try:
        eng.load()
        eng.warmup()
        with decoding_slots(eng, 16, TINY["vocab_size"]) as tokens:  # 32 prompt tokens + 5 * 2 * 6 decoded
            batched, one_by_one = decode_cpu_per_token(eng, tokens, steps=6)
            best = best_of(5, batched=batched, one_by_one=one_by_one)
    finally:
        eng.close()
        torch.set_num_threads(threads)
    assert best["batched"] < best["one_by_one"] / 3, {k: f"{v * 1e6:.0f} us/token" for k, v in best.items()}
