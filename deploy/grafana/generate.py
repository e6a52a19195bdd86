"""Writes the splitstack Grafana dashboards (`deploy/grafana/dashboards.py`) to
`deploy/grafana/*.json`: `python -m deploy.grafana.generate` from the repository root
(`make dashboards`); `--check` only compares."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from deploy.grafana.dashboards import DASHBOARDS

HERE = Path(__file__).resolve().parent


def render(model: dict) -> str:
    """The committed form: sorted keys, two-space indent, a final newline."""
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def render_all() -> dict[str, str]:
    """file name -> its JSON text."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.grafana.generate", description=__doc__)
    ap.add_argument("--out", type=Path, default=HERE, help="where to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when a file differs from what would be written")
    args = ap.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards in {args.out}: {', '.join(stale)} "
              "(run python -m deploy.grafana.generate)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
