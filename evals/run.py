"""`splitstack eval`: held-out loss, key-token / new-token loss, agreement and retrieval.

For each context length N: `n_docs` held-out documents (tokens N, tail T) give the losses;
`n_items` items per task give retrieval, split into filled-region (needles before the tail)
and tail items. Tasks are the train family (`evals.tasks`, the formats calibration and
distillation may use) and the held-out families (`evals.heldout`, formats nothing upstream
sees). Loss documents come from the stdlib docstrings' eval split below 4K tokens and from
the longer held-out texts (`evals.heldout.texts`) from 4K on (`loss_corpus`). Every arm
sees the same documents and items; intervals are 95% percentile bootstraps (5,000
resamples within task) and arms are compared to `exact` by paired differences.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from evals import catalog
from evals.corpus import SOURCE_NAME, documents, haystack_text
from evals.heldout import texts as heldout_texts
from evals.heldout.families import FAMILIES, make_family_items
from evals.metrics import (agreement, bootstrap_ci, key_token_mask, new_token_mask,
                           paired_difference, token_losses)
from evals.tasks import ALL_TASKS, TASKS, make_items
from services.prefill.lexicon import Lexicon

MAX_ANSWER_TOKENS = 40      # generated per item (multi-value; the other tasks take 14)
LOSS_CORPORA = ("auto", "stdlib", "long")
LONG_FROM = 4096            # `auto`: loss documents this long come from the long texts


@dataclass(frozen=True)
class EvalConfig:
    lengths: tuple[int, ...] = (1024, 2048)
    tasks: tuple[str, ...] = TASKS
    n_items: int = 10
    n_docs: int = 6
    tail_len: int = 256
    resamples: int = 5000
    seed: int = 0
    chat: bool = False          # wrap items in the model's chat template
    families: tuple[str, ...] = ()      # held-out families (evals.heldout.families)
    loss_corpus: str = "auto"   # stdlib docstrings, the long held-out texts, or by length

    def __post_init__(self):
        bad = set(self.tasks) - set(ALL_TASKS)
        if bad:
            raise ValueError(f"unknown tasks {sorted(bad)}; choose from {ALL_TASKS}")
        bad = set(self.families) - set(FAMILIES)
        if bad:
            raise ValueError(f"unknown held-out families {sorted(bad)}; choose from "
                             f"{tuple(FAMILIES)}")
        if self.loss_corpus not in LOSS_CORPORA:
            raise ValueError(f"loss_corpus must be one of {LOSS_CORPORA}, got "
                             f"{self.loss_corpus!r}")
        if any(n <= self.tail_len + 64 for n in self.lengths):
            raise ValueError(f"every length must exceed tail_len + 64 = {self.tail_len + 64}")
        if self.n_items < 0 or self.n_docs < 0:
            raise ValueError(f"n_items and n_docs must be ≥ 0, got {self.n_items} and "
                             f"{self.n_docs}")


@dataclass
class ArmResult:
    # metric name -> task (or "docs") -> per-item values, paired across arms by position
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # what the arm answered, one record per retrieval item (the JSON output's `completions`)
    completions: list[dict] = field(default_factory=list)

    def add(self, metric: str, group: str, value: float) -> None:
        self.values.setdefault(metric, {}).setdefault(group, []).append(value)


def loss_corpus_for(cfg: EvalConfig, length: int) -> str:
    """Name of the corpus the loss documents of `length` tokens come from."""
    long = cfg.loss_corpus == "long" or (cfg.loss_corpus == "auto" and length >= LONG_FROM)
    return heldout_texts.SOURCE_NAME if long else SOURCE_NAME


def doc_token_windows(tokenizer, n_docs: int, length: int,
                      corpus: str = SOURCE_NAME) -> list[list[int]]:
    """`n_docs` windows of `length` tokens, one per held-out document long enough."""
    out = []
    if n_docs <= 0:
        return out
    docs = documents("eval") if corpus == SOURCE_NAME else heldout_texts.long_documents()
    for doc in docs:
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n_docs:
            break
    return out


def evaluate_losses(arm, exact_arm, docs: list[list[int]], cfg: EvalConfig, result: ArmResult,
                    length: int) -> None:
    t = cfg.tail_len
    for ids in docs:
        target = torch.tensor(ids[-t:])
        exact_logits = exact_arm.tail_logits(ids, t)
        logits = exact_logits if arm is exact_arm else arm.tail_logits(ids, t)
        loss = token_losses(logits, target)                            # [T−1]
        loss_full = token_losses(exact_logits, target)
        loss_trunc = token_losses(exact_arm.tail_logits(ids[-t:], t), target)
        key = key_token_mask(loss_full, loss_trunc)
        new = torch.from_numpy(new_token_mask(ids)[-t + 1:])
        group = f"docs@{length}"
        result.add("loss", group, loss.mean().item())
        result.add("new_token_loss", group, loss[new].mean().item())
        if key.any():
            result.add("key_token_loss", group, loss[key].mean().item())
            result.add("key_tokens", group, float(key.sum()))
        agr = agreement(exact_logits[:-1], logits[:-1])
        result.add("top1_agreement", group, agr["top1"])
        result.add("kl_median", group, agr["kl_median"])
        result.add("kl_mean", group, agr["kl_mean"])


def evaluate_retrieval(arm, items_by_task, tokenizer, cfg: EvalConfig, result: ArmResult,
                       length: int) -> None:
    for task, items in items_by_task.items():
        max_tokens = (FAMILIES[task].answer_tokens if task in FAMILIES
                      else MAX_ANSWER_TOKENS if task == "multivalue" else 14)
        outs = arm.complete([it.prompt_ids for it in items], max_tokens)
        for it, out in zip(items, outs):
            text = tokenizer.decode(out, skip_special_tokens=True)
            score = it.score(text)
            region = "filled" if it.in_filled_region(cfg.tail_len) else "tail"
            result.add(f"retrieval_{region}", f"{task}@{length}", score)
            result.add("retrieval", f"{task}@{length}", score)
            result.completions.append({"task": task, "length": length,
                                       "depth": round(it.depth, 4), "region": region,
                                       "answers": it.answers, "completion": text,
                                       "score": score})


def run_eval(model_dir: str | Path, arm_names: list[str], cfg: EvalConfig,
             dtype: torch.dtype = torch.float32, log=print,
             arm_options: dict | None = None, quantization: str | None = None,
             quantize_prompts: bool = True) -> dict:
    """`arm_options` (maps_dir, split, budget, ...) go to every non-exact arm; their tail
    defaults to the eval's tail_len, so the scored tail is always computed exactly.
    `quantization` (int8): every product of the model reads its int8 copy, prompts too, so
    the losses and answers bound those of the serving mode; with `quantize_prompts` False,
    the serving mode itself (products of more than 16 rows, prompts, keep the weights)."""
    from models import load_model
    from services.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=dtype).quantize(quantization, prompts=quantize_prompts)
    # an item's answer is generated after its prompt: both must fit the model's positions
    too_long = [n for n in cfg.lengths
                if n + MAX_ANSWER_TOKENS > model.config.max_position_embeddings]
    if too_long:
        raise ValueError(f"lengths {too_long} leave no room for the answer in the model's "
                         f"context ({model.config.max_position_embeddings} positions, "
                         f"{MAX_ANSWER_TOKENS} kept for the answer)")
    # the probe arms' lexical net reads the tokenizer's pieces
    options = {"tail": cfg.tail_len, **(arm_options or {})}
    if any("+probe" in name.partition("@")[0] for name in arm_names):
        options.setdefault("lexicon", Lexicon.from_tokenizer(tokenizer, model.config.vocab_size))
    arm_objs = {name: catalog.make_arm(name, model, **({} if name == "exact" else options))
                for name in arm_names}
    exact = arm_objs.get("exact") or catalog.make_arm("exact", model)
    filler = (tokenizer(haystack_text(documents("eval")), add_special_tokens=False)["input_ids"]
              if cfg.tasks else [])
    results = {name: ArmResult() for name in arm_names}
    timings: dict[str, float] = {}
    for length in cfg.lengths:
        exact.clear_cache()
        docs = doc_token_windows(tokenizer, cfg.n_docs, length, loss_corpus_for(cfg, length))
        items = {task: make_items(task, tokenizer, filler, length, cfg.n_items, cfg.seed,
                                  cfg.chat) for task in cfg.tasks}
        items.update({f: make_family_items(f, tokenizer, length, cfg.n_items, cfg.seed)
                      for f in cfg.families})
        for name, arm in arm_objs.items():
            start = time.perf_counter()
            evaluate_losses(arm, exact, docs, cfg, results[name], length)
            evaluate_retrieval(arm, items, tokenizer, cfg, results[name], length)
            timings[f"{name}@{length}"] = time.perf_counter() - start
            log(f"[eval] {name} @ {length}: {timings[f'{name}@{length}']:.1f}s")
    summary = summarize(results, cfg, model_dir, timings)
    summary["dtype"], summary["quantization"] = str(dtype).removeprefix("torch."), quantization
    if quantization is not None:
        summary["quantized_prompts"] = quantize_prompts
    return summary


PAIRED_METRICS = ("loss", "new_token_loss", "key_token_loss", "retrieval", "retrieval_filled",
                  "top1_agreement", "kl_median", "kl_mean")


def summarize(results: dict[str, ArmResult], cfg: EvalConfig, model_dir, timings) -> dict:
    summary = {"model": str(model_dir), "corpus": SOURCE_NAME, "config": cfg.__dict__,
               "loss_corpus": {str(n): loss_corpus_for(cfg, n) for n in cfg.lengths},
               "heldout_sources": heldout_texts.sources(),
               "timings_s": timings, "arms": {}, "paired_vs_exact": {}}
    summary["paired_vs_identity"], summary["paired_vs_zero-only"] = {}, {}
    summary[MATCHED], summary[SAME_ARM] = {}, {}
    for name, res in results.items():
        arm_sum = summary["arms"][name] = {}
        if res.completions:
            summary.setdefault("completions", {})[name] = res.completions
        for metric, groups in res.values.items():
            for group, vals in groups.items():
                mean, lo, hi = bootstrap_ci({group: vals}, cfg.resamples, cfg.seed)
                arm_sum.setdefault(metric, {})[group] = {"mean": mean, "ci": [lo, hi],
                                                         "n": len(vals)}
            mean, lo, hi = bootstrap_ci(groups, cfg.resamples, cfg.seed)   # within-group
            arm_sum[metric]["all"] = {"mean": mean, "ci": [lo, hi],
                                      "n": sum(len(v) for v in groups.values())}
        for key, ref in _references(name, results):
            ex = results[ref].values
            for metric in PAIRED_METRICS:
                if metric in res.values and metric in ex:
                    mean, lo, hi = paired_difference(res.values[metric], ex[metric],
                                                     cfg.resamples, cfg.seed)
                    summary[key].setdefault(name, {"against": ref})[metric] = {
                        "mean": mean, "ci": [lo, hi]}
    return summary


# a fill arm with exact rows (`ridgefill+probe`) is also paired with identity fill given the
# same selector (`identity+probe`): both compute the same kind of rows exactly, so the
# difference is the fill of the rest
MATCHED = "paired_vs_identity_same_selector"
# an arm in another fill dtype (`ridgefill@bfloat16`) against the same arm in the model's
SAME_ARM = "paired_vs_model_dtype"


def _references(name: str, results) -> list[tuple[str, str]]:
    """(summary key, reference arm) pairs that arm `name` is compared with."""
    refs = [(f"paired_vs_{ref}", ref) for ref in ("exact", "identity", "zero-only")
            if name != ref and ref in results]
    base, _, fill_dtype = name.partition("@")
    if base.startswith("ridgefill+"):
        twin = "identity+" + base.split("+", 1)[1] + (f"@{fill_dtype}" if fill_dtype else "")
        if twin in results:
            refs.append((MATCHED, twin))
    if fill_dtype and base in results:
        refs.append((SAME_ARM, base))
    return refs


OVERVIEW = (("retrieval_filled", "filled-region retrieval", True), ("retrieval", "retrieval", True),
            ("new_token_loss", "new-token loss", False), ("key_token_loss", "key-token loss", False),
            ("top1_agreement", "top-1 agreement", True), ("kl_median", "KL median", False),
            ("kl_mean", "KL mean", False))


def overview_table(summary: dict) -> str:
    """One row per arm, every metric pooled over lengths and tasks (95% bootstrap CI)."""
    cols = [c for c in OVERVIEW if any(c[0] in m for m in summary["arms"].values())]
    lines = ["| arm | " + " | ".join(c[1] for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for name, metrics in summary["arms"].items():
        cells = []
        for key, _, pct in cols:
            s = metrics.get(key, {}).get("all")
            if s is None:
                cells.append("–")
                continue
            f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.3f}")
            cells.append(f"{f(s['mean'])} [{f(s['ci'][0])}, {f(s['ci'][1])}]")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def retrieval_table(summary: dict, metric: str = "retrieval") -> str:
    """One row per task or family and arm, one column per length: mean [95% CI] (n)."""
    cells: dict[tuple[str, str], dict[int, dict]] = {}
    lengths: set[int] = set()
    for name, metrics in summary["arms"].items():
        for group, s in metrics.get(metric, {}).items():
            task, _, length = group.rpartition("@")
            if task:
                cells.setdefault((name, task), {})[int(length)] = s
                lengths.add(int(length))
    if not cells:
        return ""
    cols = sorted(lengths)
    lines = ["| arm | task | " + " | ".join(f"{n}" for n in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    tasks = list(dict.fromkeys(task for _, task in cells))
    arms = list(summary["arms"])
    for name, task in sorted(cells, key=lambda k: (tasks.index(k[1]), arms.index(k[0]))):
        by_len, row = cells[(name, task)], []
        for n in cols:
            s = by_len.get(n)
            row.append("–" if s is None else f"{100 * s['mean']:.0f}% [{100 * s['ci'][0]:.0f}, "
                       f"{100 * s['ci'][1]:.0f}] ({s['n']})")
        kind = "held-out" if task in FAMILIES else "train"
        lines.append(f"| `{name}` | {task} ({kind}) | " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_table(summary: dict) -> str:
    lines = ["## Overview\n", overview_table(summary), ""]
    for metric, title in (("retrieval", "Retrieval"),
                          ("retrieval_filled", "Filled-region retrieval")):
        table = retrieval_table(summary, metric)
        if table and (metric == "retrieval" or len(summary["arms"]) > 1):
            lines += [f"## {title} by task and length (tokens)\n", table, ""]
    for name, metrics in summary["arms"].items():
        lines.append(f"### arm `{name}`\n")
        lines.append("| metric | group | mean | 95% CI | n |\n|---|---|---|---|---|")
        for metric, groups in metrics.items():
            for group, s in sorted(groups.items()):
                pct = metric.startswith("retrieval")
                fmt = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.3f}")
                lines.append(f"| {metric} | {group} | {fmt(s['mean'])} | "
                             f"[{fmt(s['ci'][0])}, {fmt(s['ci'][1])}] | {s['n']} |")
        lines.append("")
    for key in ("paired_vs_exact", "paired_vs_identity", "paired_vs_zero-only", MATCHED,
                SAME_ARM):
        for name, metrics in summary.get(key, {}).items():
            lines.append(f"### `{name}` − `{metrics['against']}` (paired)\n")
            lines.append("| metric | mean | 95% CI |\n|---|---|---|")
            for metric, s in metrics.items():
                if metric == "against":
                    continue
                lines.append(f"| {metric} | {s['mean']:+.3f} | [{s['ci'][0]:+.3f}, "
                             f"{s['ci'][1]:+.3f}] |")
            lines.append("")
    lines.append(f"corpus: {summary['corpus']} (held-out split); tail_len "
                 f"{summary['config']['tail_len']}")
    loss = summary.get("loss_corpus", {})
    if loss:
        lines.append("\nloss documents: " + ", ".join(f"{n} tokens from {c}"
                                                      for n, c in loss.items()))
    if summary.get("config", {}).get("families"):
        src = ", ".join(f"{k} {v} documents" for k, v in summary["heldout_sources"].items())
        lines.append(f"\nheld-out families' essays: {heldout_texts.SOURCE_NAME} ({src})")
    return "\n".join(lines)


def write_outputs(summary: dict, out: str | Path | None) -> str:
    table = markdown_table(summary)
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))
        out.with_suffix(".md").write_text(table + "\n")
    return table
