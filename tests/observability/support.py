"""Helpers shared by the observability tests (kept out of conftest so tests can import them); waiting,
ports and health come from tests/support.py."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

KV_CACHE_BYTES = 16 * 1024 * 1024


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def provider(name: str, exporter: InMemorySpanExporter) -> TracerProvider:
    p = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    p.add_span_processor(SimpleSpanProcessor(exporter))
    return p


@dataclass
class Stack:
    frontend_port: int
    engine_metrics_port: int
    frontend_metrics_port: int
    exporter: InMemorySpanExporter
    engine_server: Any
    frontend: Any
