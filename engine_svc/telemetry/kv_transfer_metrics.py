"""Prometheus counters of prefill/decode disaggregation (engine_svc/kv_transfer/), read at every scrape."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_svc.kv_transfer.connector import KVConnector


class KvTransferCollector(Collector):
    def __init__(self, model_name: str, connector: KVConnector) -> None:
        self._labels = [model_name]
        self._connector = connector

    def collect(self) -> Iterable[Metric]:
        c = self._connector
        counters = [
            ("tandem_kv_transfer_pulls", "K/V pulls this engine started (consumer)", c.num_pulls),
            ("tandem_kv_transfer_pull_failures", "K/V pulls that failed (consumer; the policy decided the rest)",
             c.num_pull_failures),
            ("tandem_kv_transfer_blocks_pulled", "K/V blocks this engine pulled (consumer)", c.num_blocks_pulled),
        ]
        gauges = []
        if c.leases is not None:
            counters += [
                ("tandem_kv_transfer_leases_pulled", "Kept K/V pulled by a consumer (producer)", c.leases.num_pulled),
                ("tandem_kv_transfer_leases_expired", "Kept K/V freed unpulled at its lease's end (producer)",
                 c.leases.num_expired),
                ("tandem_kv_transfer_leases_released", "Kept K/V freed by an abort (producer)", c.leases.num_released),
            ]
            gauges.append(("tandem_kv_transfer_blocks_kept", "K/V blocks kept for consumers (producer)",
                           c.leases.num_blocks_held))
        out: list[Metric] = []
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self._labels, float(value))
            out.append(counter)
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(self._labels, float(value))
            out.append(gauge)
        return out
