"""A Prometheus collector that re-exports what other processes exported (their exposition
text, as last polled), so one `/metrics` shows them: the attention services, pool and
prefill replicas behind a Q-First gateway, or the engine process behind an embedded one."""
from __future__ import annotations

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families


class ReExported:
    def __init__(self, label: str | None = "member"):
        """`label`: each sample gets this label with its source's name; None re-exports
        the samples unchanged (a single source)."""
        self.label = label
        self.latest: dict[str, str] = {}      # source -> its exposition text

    def collect(self):
        merged: dict[str, Metric] = {}
        for source, text in sorted(self.latest.items()):
            for fam in text_string_to_metric_families(text):
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
                for sample in fam.samples:
                    labels = sample.labels if self.label is None else {**sample.labels,
                                                                      self.label: source}
                    out.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield from merged.values()
