"""The report's plots (matplotlib, written as PNG without a display): TTFT and ITL CDFs
with one line per sweep point, and throughput and latency against concurrency or rate."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

plt.rcParams.update({"font.size": 11, "axes.grid": True, "grid.alpha": 0.3,
                     "figure.dpi": 110, "savefig.bbox": "tight"})


def point_label(p: dict) -> str:
    if p["request_rate"] == "inf":
        return f"concurrency {p['max_concurrency']}"
    cap = f", ≤{p['max_concurrency']} in flight" if p["max_concurrency"] else ""
    return f"{p['request_rate']:g} req/s{cap}"


def sweep_axis(result: dict) -> tuple[list[float], str]:
    points = result["points"]
    if result["mode"] == "concurrency":
        return [p["max_concurrency"] for p in points], "concurrency (clients)"
    return [p["request_rate"] for p in points], "offered load (requests/s)"


def title(result: dict, what: str) -> str:
    return f"{what} — {result['workload']}, {result['model_id']}"


def cdf(path: Path, result: dict, samples: list[list[float]], what: str, xlabel: str,
        ylabel: str) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for p, values in zip(result["points"], samples):
        v = np.sort(np.asarray(values, dtype=float) * 1000.0)
        if v.size:           # from (first, 0): a single sample still shows as a step
            ax.step(np.r_[v[0], v], np.r_[0.0, np.arange(1, v.size + 1) / v.size],
                    where="post", label=f"{point_label(p)} (n={v.size})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.set_title(title(result, what))
    if ax.lines:
        ax.legend(loc="lower right")
        if max(line.get_xdata().max() for line in ax.lines) > 20 * max(
                min(line.get_xdata().min() for line in ax.lines), 1e-3):
            ax.set_xscale("log")
    fig.savefig(path)
    plt.close(fig)


def throughput(path: Path, result: dict) -> None:
    x, xlabel = sweep_axis(result)
    pts = result["points"]
    fig, (tok, req) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    tok.plot(x, [p["output_throughput"] for p in pts], "o-", label="output tokens/s")
    tok.plot(x, [p["total_token_throughput"] for p in pts], "s--",
             label="total tokens/s (prompt + output)")
    tok.set_ylabel("tokens per second")
    tok.set_title("Token throughput")
    req.plot(x, [p["request_throughput"] for p in pts], "^-", color="tab:red",
             label="completed requests/s")
    req.set_ylabel("requests per second")
    req.set_title("Request throughput")
    for ax in (tok, req):
        ax.set_xlabel(xlabel)
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-3) * 1.15)
        ax.legend(loc="best")
        _sweep_ticks(ax, x, result)
    fig.suptitle(title(result, "Throughput"))
    fig.savefig(path)
    plt.close(fig)


def latency(path: Path, result: dict) -> None:
    x, xlabel = sweep_axis(result)
    pts = result["points"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for ax, metrics, what in ((axes[0], ("ttft", "e2el"), "TTFT and end-to-end latency"),
                              (axes[1], ("tpot", "itl"), "TPOT and inter-token latency")):
        for m, style in zip(metrics, ("tab:blue", "tab:orange")):
            name = m.upper()
            ax.plot(x, [p[f"median_{m}_ms"] for p in pts], "o-", color=style,
                    label=f"{name} median")
            ax.plot(x, [p[f"p99_{m}_ms"] for p in pts], "o--", color=style, alpha=0.7,
                    label=f"{name} p99")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("milliseconds")
        ax.set_ylim(bottom=0)
        ax.set_title(what)
        ax.legend(loc="upper left")
        _sweep_ticks(ax, x, result)
    fig.suptitle(title(result, "Latency"))
    fig.savefig(path)
    plt.close(fig)


def _sweep_ticks(ax, x: list[float], result: dict) -> None:
    if result["mode"] == "concurrency" and len(x) > 1 and max(x) / min(x) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{v:g}" for v in x])
    ax.minorticks_off()


def write_plots(out: Path, result: dict) -> list[str]:
    """The four plots into `out`; their file names. The CDFs count what the percentiles
    count: completed requests and the cancelled ones' censored times, not failures."""
    pts = result["points"]
    cdf(out / "ttft_cdf.png", result,
        [[t for t, s in zip(p["ttfts"], p["statuses"]) if s != "failed"] for p in pts],
        "TTFT distribution", "time to first token (ms)", "share of requests with TTFT ≤ x")
    cdf(out / "itl_cdf.png", result,
        [[x for itl, s in zip(p["itls"], p["statuses"]) if s != "failed" for x in itl]
         for p in pts],
        "Inter-token latency distribution", "inter-token latency (ms)",
        "share of gaps ≤ x")
    throughput(out / "throughput.png", result)
    latency(out / "latency.png", result)
    return ["ttft_cdf.png", "itl_cdf.png", "throughput.png", "latency.png"]
