"""A Prometheus collector that re-exports what another process exported (its exposition
text, as last polled), so one `/metrics` shows both: the engine process behind an embedded
gateway."""
from __future__ import annotations

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families


class ReExported:
    def __init__(self):
        self.latest: dict[str, str] = {}      # source -> its exposition text

    def collect(self):
        merged: dict[str, Metric] = {}
        for _, text in sorted(self.latest.items()):
            for fam in text_string_to_metric_families(text):
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
                out.samples.extend(fam.samples)
        yield from merged.values()
