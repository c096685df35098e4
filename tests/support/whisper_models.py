"""Tiny random Whisper models saved as transformers directories (no download): English-only
with the embedded model's tokenizer, or multilingual with that tokenizer's special tokens laid
out as a multilingual Whisper's (one more text token, the empty one, so `<|endoftext|>` is 50257
and the vocabulary 51865), optionally with 128 log-mel bins as large-v3's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rtmedia.engines.asr.whisper_model import embedded_model_dir


def multilingual_tokenizer(english: dict) -> dict:
    """The embedded tokenizer.json with every special token one id later and the freed id the
    empty text token (the multilingual vocabulary's layout; its text tokens are not the real ones)."""
    data = json.loads(json.dumps(english))
    eot = next(t["id"] for t in data["added_tokens"] if t["content"] == "<|endoftext|>")
    for token in data["added_tokens"]:
        token["id"] += token["id"] >= eot
    vocab = data["model"]["vocab"]
    vocab["<|endoftext|>"] = eot + 1
    vocab[""] = eot  # multilingual Whisper's empty text token: CTranslate2 tells the layouts apart by it
    for special in data["post_processor"]["special_tokens"].values():
        special["ids"] = [i + (i >= eot) for i in special["ids"]]
    return data


def tiny_whisper(path: Path, multilingual: bool = False, mels: int = 80, seed: int = 0) -> Path:
    """A tiny random `WhisperForConditionalGeneration` with its tokenizer, saved to `path`."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration, WhisperTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    english = json.loads((embedded_model_dir() / "tokenizer.json").read_text())
    tokenizer = multilingual_tokenizer(english) if multilingual else english
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=51865 if multilingual else 51864, num_mel_bins=mels, d_model=64,
                           encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
                           max_target_positions=448, bos_token_id=ids["<|endoftext|>"],
                           eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
                           decoder_start_token_id=ids["<|startoftranscript|>"])
    model = WhisperForConditionalGeneration(config)
    embedded = json.loads((embedded_model_dir() / "config.json").read_text())
    eot = ids["<|endoftext|>"]
    shift = int(multilingual)  # the multilingual layout's special tokens are one id later
    generation = model.generation_config
    generation.suppress_tokens = [t + shift * (t >= 50256) for t in embedded["suppress_ids"]]
    generation.begin_suppress_tokens = [220, eot]
    generation.no_timestamps_token_id = ids["<|notimestamps|>"]
    generation.is_multilingual = multilingual
    generation._from_model_config = False  # else transformers rebuilds it from the model config on load
    if multilingual:
        generation.lang_to_id = {c: i for c, i in ids.items() if len(c) <= 9 and c[2:-2].isalpha() and
                                 c[2:-2] not in ("transcribe", "translate", "startoflm", "nocaptions")}
        generation.task_to_id = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    model.save_pretrained(path)
    WhisperTokenizerFast(tokenizer_file=str(path / "tokenizer.json")).save_pretrained(path)
    return path
