"""The fake server's ``/metrics``: SGLang's Prometheus metrics of one scheduler (the
``SchedulerMetricsCollector`` of ``python/sglang/srt/metrics/collector.py``, read for
this file), from the torch engine's own counts.

Served only with ``--enable-metrics``, as SGLang mounts the route. Every sample carries
the scheduler's labels (``model_name``, ``engine_type="unified"``, ``tp_rank``,
``pp_rank``, ``moe_ep_rank``; only the first TP rank's scheduler reports, SGLang's
default). Counters:

- ``sglang:cuda_graph_passes_total{mode="decode_none"}``: one per decode batch
  (``increment_cuda_graph_pass``, from ``process_batch_result_decode``; the torch engine
  has no CUDA graphs);
- ``sglang:gpu_execution_seconds_total{category="forward_decode" | "forward_extend"}``:
  the seconds of its decode and prefill steps (``increment_gpu_execution_seconds``, the
  scheduler's ``record_forward_metrics``: ``"forward_" + forward_mode.name.lower()``),
  only with ``SGLANG_ENABLE_METRICS_DEVICE_TIMER=1``;
- ``sglang:realtime_tokens_total{mode="prefill_compute" | "prefill_cache" | "decode"}``;

and the gauges ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:num_used_tokens``, ``sglang:token_usage``. A labelled counter shows no sample
until it is first incremented, as ``prometheus_client`` writes it.

Differences: the counts are current at every read, where SGLang updates
``realtime_tokens_total`` and the gauges once per logging interval; the device timer's
seconds are the engine's wall-clock step times.
"""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from dynarl.workers.rollout import EngineLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The exposition format's content type (``prometheus_client.CONTENT_TYPE_LATEST``'s
text format)."""


class SchedulerMetrics(Collector):
    """The metrics of one scheduler whose engine reports ``stats()``.

    Args:
        stats: the engine's load and step counts.
        model_name: the ``model_name`` label (the served model's path).
        device_timer: whether forward passes are timed
            (``SGLANG_ENABLE_METRICS_DEVICE_TIMER``).
    """

    def __init__(
        self, stats: Callable[[], EngineLoad], *, model_name: str, device_timer: bool
    ) -> None:
        self._stats = stats
        self._device_timer = device_timer
        self._labels = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    async def respond(self, request: Request) -> Response:
        """The ``/metrics`` endpoint: the exposition of the metrics now."""
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE)

    def collect(self) -> Iterator[Metric]:
        """The metrics now (``prometheus_client``'s collector protocol)."""
        load = self._stats()
        names, values = list(self._labels), list(self._labels.values())

        def counter(name: str, doc: str, label: str, counts: dict[str, float]) -> Metric:
            family = CounterMetricFamily(name, doc, labels=[*names, label])
            for key, count in counts.items():
                if count > 0:
                    family.add_metric([*values, key], count)
            return family

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("sglang:num_running_reqs", "The number of running requests.", load.num_running)
        yield gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            load.num_queued,
        )
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", load.kv_tokens)
        yield gauge("sglang:token_usage", "The token usage.", load.kv_usage)
        yield counter(
            "sglang:cuda_graph_passes_total",
            "Total number of forward passes categorized by CUDA graph.",
            "mode",
            {"decode_none": load.decode_steps},
        )
        yield counter(
            "sglang:gpu_execution_seconds_total",
            "Total time that GPU is busy executing a workload. Refer to ForwardMode for "
            "category labels.",
            "category",
            {"forward_decode": load.decode_s, "forward_extend": load.prefill_s}
            if self._device_timer
            else {},
        )
        yield counter(
            "sglang:realtime_tokens_total",
            "Total number of tokens processed (updated on each log interval). mode: "
            "prefill_compute, prefill_cache, decode.",
            "mode",
            {
                "prefill_compute": load.prefill_tokens,
                "prefill_cache": load.prefix_hit_tokens,
                "decode": load.decode_tokens,
            },
        )
