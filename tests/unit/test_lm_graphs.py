"""The LM engine's graph path on the CPU: the static decode step (what a GPU captures as CUDA graphs)
padded to its bucket gives the logits of unpadded batches and of the full model; warm-up captures one
graph per padded batch size and decodes replay them (through a stand-in capture backend); the plain
CPU path stays eager and is counted `ineligible`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rtmedia.engines.graphs import GraphConfig, GraphRunner
from rtmedia.engines.lm.engine import LmEngine
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.graphs import FakeBackend
from tests.unit.test_lm_engine import Sessions, _prompt, _save, assert_close


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM)


def _engine(model_dir: Path, **kw: object) -> LmEngine:
    eng = LmEngine(model_dir, **{"slots": 6, "context": 64, "batch_sizes": (1, 2, 4), **kw})  # type: ignore[arg-type]
    eng.load()
    eng.warmup()
    return eng


def test_static_decode_padding_matches_unpadded_batches(model_dir: Path) -> None:
    prompts = [_prompt(n, seed) for seed, n in enumerate((3, 12, 5))]
    static = Sessions(_engine(model_dir, static_decode=True))
    assert static.eng.static_decode and static.eng.padded_size(3) == 4
    slots = [static.join(p) for p in prompts]
    steps = [static.step() for _ in range(4)]  # each step checked against the full model by Sessions

    eager = _engine(model_dir)  # the CPU path: per-row spans, no padding to the context
    solo = _engine(model_dir, static_decode=True)
    assert not eager.static_decode
    for slot, prompt in zip(slots, prompts, strict=True):
        pair = []
        for eng in (eager, solo):
            own = eng.acquire()
            assert own is not None
            eng.prefill(own, prompt)
            pair.append((eng, own))
        for k in range(4):
            token = static.seq[slot][len(prompt) + k]
            for eng, own in pair:  # alone: padded to bucket 1
                assert_close(eng.decode({own: token})[own], steps[k][slot], f"slot {slot} step {k}")
        for eng, own in pair:
            eng.release(own)
    assert static.eng.graphs.stats.misses["ineligible"] > 0 and static.eng.graphs.stats.graphs == 0


def test_warmup_captures_each_bucket_and_decodes_replay(model_dir: Path) -> None:
    backend = FakeBackend()
    runner = GraphRunner("lm", GraphConfig(max_graphs=1), backend)
    eng = _engine(model_dir, graphs=runner)
    assert eng.static_decode  # auto: the backend takes these tensors
    assert eng.batch_sizes == (1, 2, 4, 6)  # capped at, and completed by, the slots
    assert runner.stats.pinned == 4 and backend.captures == 4  # not limited by max_graphs
    replays = backend.replays
    s = Sessions(eng)
    a, b = s.join(_prompt(4, 1)), s.join(_prompt(9, 2))
    for _ in range(2):
        s.step()  # bucket 2
    c = s.join(_prompt(2, 3))
    s.step()  # bucket 4
    s.leave(a)
    s.leave(b)
    for _ in range(2):
        s.step()  # bucket 1, c alone
    assert backend.replays - replays == 5 and backend.captures == 4
    assert runner.stats.miss_total == 0 and sorted(s.seq) == [c]
    eng.close()
    assert runner.stats.graphs == 0


def test_cpu_decode_is_eager_and_counted(model_dir: Path) -> None:
    eng = _engine(model_dir)
    before = eng.graphs.stats.misses["ineligible"]
    slot = eng.acquire()
    assert slot is not None
    eng.prefill(slot, [1, 2, 3])
    eng.decode({slot: 4})
    assert eng.graphs.stats.misses["ineligible"] == before + 1 and eng.graphs.stats.hits == 0
    logits = eng.decode({slot: 5})[slot]
    with torch.inference_mode():
        full = eng.model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits[0, -1]
    assert_close(logits, full, "eager decode")
