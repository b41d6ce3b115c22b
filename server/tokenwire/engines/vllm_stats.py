"""The statistics loggers tokenwire gives vLLM's `AsyncLLM`.

vLLM calls each logger's `record` once per engine step, on the event loop,
between the steps' outputs. Two loggers:

- `LoadTracker`: each data-parallel rank's latest running/waiting counts,
  behind /healthz, the load figures and admission.
- `BatchedMetrics`: vLLM's own `vllm:*` Prometheus metrics, unchanged, but
  recorded in batches. vLLM's logger makes some twenty metric updates per
  step; made one step at a time, between engine steps that evict the caches,
  they cost about as much CPU as tokenwire's whole protocol work per token at
  c=8. Made back to back they cost a fraction. A scrape of /metrics flushes
  first, so what it shows is exact.

vLLM's third logger, the periodic "Avg prompt throughput" line, is not made:
only vLLM's own server prints it, on a timer tokenwire does not run.

Classes are built on first use: importing vLLM takes seconds.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .. import metrics

# Steps recorded per batch when nobody scrapes: bounds what is held (a few
# small objects per step) and how stale the metrics get for other readers.
BATCH_STEPS = 128


def async_llm(args: Any, tracker: type) -> Any:
    """vLLM's `AsyncLLM` from engine args, with these loggers (blocks ~25 s)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    # Stats stay on: custom loggers turn them on. `disable_log_stats` only
    # leaves out the log-line logger.
    return AsyncLLM.from_vllm_config(
        args.create_engine_config(),
        stat_loggers=[tracker, batched_metrics_class()],
        enable_log_requests=args.enable_log_requests,
        disable_log_stats=True,
    )


def load_tracker_class() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadTracker(StatLoggerBase):
        """Keeps each data-parallel rank's latest running/waiting counts."""

        by_rank: ClassVar[dict[int, dict[str, int]]] = {}

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        @classmethod
        def totals(cls) -> dict[str, int]:
            ranks = list(cls.by_rank.values())
            return {k: sum(r[k] for r in ranks) for k in ("running", "waiting")}

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                LoadTracker.by_rank[engine_idx] = {
                    "running": scheduler_stats.num_running_reqs,
                    "waiting": scheduler_stats.num_waiting_reqs
                    + scheduler_stats.num_skipped_waiting_reqs,
                }

        def log_engine_initialized(self) -> None:
            pass

    return LoadTracker


def batched_metrics_class() -> type:
    # A subclass, so vLLM adds no Prometheus logger of its own beside it.
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class BatchedMetrics(PrometheusStatLogger):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            super().__init__(vllm_config, engine_indexes)
            self.pending: list[tuple[Any, Any, Any, int]] = []
            metrics.before_scrape(self.flush)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            self.pending.append((scheduler_stats, iteration_stats, mm_cache_stats, engine_idx))
            if len(self.pending) >= BATCH_STEPS:
                self.flush()

        def flush(self) -> None:
            pending, self.pending = self.pending, []
            record = super().record
            for scheduler_stats, iteration_stats, mm_cache_stats, engine_idx in pending:
                record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)

    return BatchedMetrics
