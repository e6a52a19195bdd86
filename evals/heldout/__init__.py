"""Held-out retrieval formats and long held-out text: what the eval measures and nothing in
calibration or distillation reads (the train family is `evals.tasks` on `evals.corpus`)."""
