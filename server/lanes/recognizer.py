"""The recogniser and its two lanes: built by name through engines/asr/registry.py, run by its own plan.

`build_recognizer` turns the `asr` settings and the placement (device, CUDA graphs) into the engines'
`RecognizerSettings` and builds the recogniser the `asr` setting names. `add_recognizer` registers its
lanes with the scheduler from the recogniser's `lane_plan`: `asr` for audio, `asr_final` for the
items that only end an utterance (stepped with `urgent=True`), so a turn's final never queues behind
other streams' audio, and its gauges in the metrics. Nothing here knows which recogniser it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from rtmedia.engines.asr.contract import AsrItem, Recognizer, RecognizerSettings
from rtmedia.engines.asr.registry import RECOGNIZERS
from rtmedia.engines.base import EngineError
from rtmedia.engines.graphs import GraphRunner
from rtmedia.server.config import AsrSettings, ServerConfig
from rtmedia.server.lanes.access import ASR, ASR_FINAL
from rtmedia.server.lanes.placement import Placement, graph_runner
from rtmedia.server.lanes.scheduler import LanePolicy, Priority, Scheduler
from rtmedia.server.observe.metrics import Metrics


def recognizer_settings(asr: AsrSettings, where: Placement, metrics: Metrics | None,
                        reply_timeout_s: float | None = None) -> RecognizerSettings:
    """The engines' view of the `asr` settings on this placement: a runtime that captures CUDA graphs
    gets a runner of its own cap (`asr_max_graphs`, a failed capture running eagerly) counting into
    the metrics as engine `asr`; decode batches and worker restarts count into the metrics."""

    def graphs(max_graphs: int) -> GraphRunner:
        capped = replace(where, graphs=replace(where.graphs, max_graphs=max_graphs, eager_after_failure=True))
        return graph_runner("asr", capped, metrics)

    return RecognizerSettings(
        model=asr.model, runtime=asr.backend, compute_type=asr.compute_type, threads=asr.threads,
        parallel=asr.parallel, workers=asr.workers, decoders=asr.decoders, device=str(where.device),
        cuda=where.cuda, max_graphs=asr.max_graphs, reply_timeout_s=reply_timeout_s, graph_runner=graphs,
        on_batch=functools.partial(_count_batch, metrics) if metrics is not None else None,
        on_restart=functools.partial(_count_restart, metrics) if metrics is not None else None)


def build_recognizer(config: ServerConfig, where: Placement, metrics: Metrics | None,
                     reply_timeout_s: float | None = None) -> Recognizer:
    """The recogniser the `asr` setting names (engines/asr/registry.py). A model directory it cannot
    read is a ValueError naming `asr_model` and the file."""
    asr = config.asr
    try:
        return RECOGNIZERS.build(asr.engine, recognizer_settings(asr, where, metrics, reply_timeout_s))
    except EngineError as exc:
        raise ValueError(f"asr_model: {exc}") from None


def add_recognizer(scheduler: Scheduler, recognizer: Recognizer, metrics: Metrics,
                   deadline: Callable[[str], float | None]) -> None:
    """The recogniser's `asr` and `asr_final` lanes, as its plan says, and its gauges (read when scraped)."""
    plan = recognizer.lane_plan
    for gauge in plan.gauges:
        metric = getattr(metrics, gauge.metric)
        (metric.labels(gauge.label) if gauge.label is not None else metric).set_function(gauge.read)
    scheduler.add(ASR, recognizer, LanePolicy(Priority.REALTIME, max_batch=plan.max_batch, concurrency=plan.runners,
                                              shard=plan.shard, step_deadline_s=deadline(ASR)))
    scheduler.add(ASR_FINAL, recognizer, LanePolicy(Priority.REALTIME, max_batch=plan.max_batch,
                                                    concurrency=plan.final_runners, shard=plan.final_shard,
                                                    step_deadline_s=deadline(ASR_FINAL)),
                  functools.partial(_urgent, recognizer))


def add_asr(config: ServerConfig, scheduler: Scheduler, where: Placement, metrics: Metrics,
            deadline: Callable[[str], float | None]) -> Recognizer:
    """Build the recogniser and add its lanes. A recogniser with worker processes restarts a worker
    silent past the lanes' step deadline, so a hung worker's lane recovers at its deadline."""
    silent = max(deadline(ASR) or 0, deadline(ASR_FINAL) or 0) or None
    recognizer = build_recognizer(config, where, metrics, silent)
    add_recognizer(scheduler, recognizer, metrics, deadline)
    return recognizer


def _urgent(recognizer: Recognizer, items: list[AsrItem]) -> list[object]:
    """An `asr_final` step: items that only end an utterance, answered beside a step of the other lane."""
    return list(recognizer.step(items, urgent=True))


def _count_batch(metrics: Metrics, kind: str, decodes: int) -> None:
    metrics.asr_decodes.labels(kind).inc(decodes)
    metrics.asr_batch.labels(kind).observe(decodes)


def _count_restart(metrics: Metrics, worker: int) -> None:
    metrics.asr_worker_restarts.labels(str(worker)).inc()
