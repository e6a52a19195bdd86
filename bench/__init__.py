"""Benchmarks, one folder per subject (peers, qfirst, ridgefill, tail_replay, serving,
quality), each script run as a module from the repository root, e.g.
`python -m bench.serving.engine_vs_hf`; their recorded outputs are in `bench/results/`."""
