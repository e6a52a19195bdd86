"""Paired runs of one benchmark on two revisions: is a change within noise, or faster?

    python -m bench.revisions --base REV [--runs 5] \
        --metric 'NAME=REGEX' [--metric ...] [--lower-is-better NAME,...] -- -m BENCH ARGS...

Checks REV out as a git worktree beside this tree (the model zoo and the generated proto
stubs linked in, not copied), then runs `python -m BENCH ARGS` in each tree's root (a
revision older than the bench package takes `-- bench/SCRIPT.py ARGS`), alternately in
the base and in this tree, `--runs` pairs, the first of each pair alternating too, so a load drifting on
the machine hits both alike. Each `--metric` regex's first group is read from a run's
output (the last match). Prints every pair, and per metric the median of the per-pair
ratios this tree / base; lower-is-better metrics (times) print base / this tree instead,
so above 1 always means this tree is faster.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT
LINKED = ["services/common/pb/splitstack_pb2.py", "services/common/pb/splitstack_pb2_grpc.py"]


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="splitstack-base-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT,
                   check=True, capture_output=True)
    for name in LINKED:
        if (ROOT / name).exists() and not (path / name).exists():
            (path / name).symlink_to(ROOT / name)
    zoo = ROOT / "models" / "zoo"
    for child in zoo.iterdir():             # checkpoints are built, not committed
        target = path / "models" / "zoo" / child.name
        if child.is_dir() and (child / "config.json").exists() and not target.exists():
            target.symlink_to(child)
    return path


def run(tree: Path, argv: list[str], metrics: dict[str, re.Pattern]) -> dict[str, float]:
    out = subprocess.run([sys.executable, *argv], cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree}: {' '.join(argv)} failed ({out.returncode}):\n"
                         f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    got = {}
    for name, pattern in metrics.items():
        found = pattern.findall(out.stdout)
        if not found:
            raise SystemExit(f"{tree}: metric {name!r} not found in:\n{out.stdout[-3000:]}")
        got[name] = float(found[-1])
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--metric", action="append", required=True, help="NAME=REGEX")
    parser.add_argument("--lower-is-better", default="", help="comma-separated names")
    parser.add_argument("bench", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = [a for a in args.bench if a != "--"]
    metrics = {}
    for spec in args.metric:
        name, _, regex = spec.partition("=")
        metrics[name] = re.compile(regex, re.M)
    lower = set(filter(None, args.lower_is_better.split(",")))
    base = worktree(args.base)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()
    print(f"base {args.base} vs this tree ({head}, uncommitted changes included): "
          f"{' '.join(argv)}", flush=True)
    ratios = {name: [] for name in metrics}
    try:
        for i in range(args.runs):
            order = [("base", base), ("this", ROOT)]
            got = {}
            for label, tree in (order if i % 2 == 0 else order[::-1]):
                got[label] = run(tree, argv, metrics)
            for name in metrics:
                b, t = got["base"][name], got["this"][name]
                ratios[name].append(b / t if name in lower else t / b)
            print(f"pair {i + 1}: " + "; ".join(
                f"{n} base {got['base'][n]:g} this {got['this'][n]:g}" for n in metrics),
                flush=True)
        print("\n| metric | median ratio (>1: this tree faster) | per pair |")
        print("|---|---|---|")
        for name, r in ratios.items():
            print(f"| {name} | {statistics.median(r):.3f} | "
                  f"{', '.join(f'{x:.3f}' for x in r)} |")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
