"""Load generator for an OpenAI-compatible server: scenarios (`loadtest.scenarios`) and
vLLM's datasets (`loadtest.datasets`), a closed- or open-loop driver bounded in requests
and time (`loadtest.runner`), `vllm bench serve`'s figures with goodput
(`loadtest.stats`), the server's counters (`loadtest.server_metrics`) and a report with
plots (`loadtest.report`). Run it as `splitstack loadtest` or `python -m loadtest`;
`loadtest/locustfile.py` is the built-in workload for Locust. It imports nothing of the server: it only speaks HTTP."""
from loadtest.client import LoadTestError
from loadtest.datasets import DATASETS, DatasetConfig
from loadtest.runner import RunConfig, run_sweep
from loadtest.scenarios import SCENARIOS, ScenarioConfig

__all__ = ["DATASETS", "DatasetConfig", "LoadTestError", "RunConfig", "SCENARIOS",
           "ScenarioConfig", "run_sweep"]
