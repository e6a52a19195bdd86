"""A Prometheus collector that re-exports what another process exported (its exposition
text, as last polled), so one `/metrics` shows both: the engine process behind an embedded
gateway."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class ReExported:
    def __init__(self):
        self.text = ""                 # the other process's exposition, as last polled

    def collect(self):
        yield from text_string_to_metric_families(self.text)
