"""Structured outputs on JSONSchemaBench: coverage, validity, grammar compile time, and
constrained decode throughput against unconstrained, in one run.

    python -m bench.structured [--validity 48] [--max-tokens 256] [--decode-tokens 64] [--qfirst]

- Coverage: each of the 240 schemas of `tests/data/jsonschemabench/` (six subsets) compiled
  by the engine's grammar compiler: the share compiled, and the share refused with a
  RequestError (the API's 400). Anything else raised is counted as a crash.
- Compile time: p50 / p99 per schema, cold (first compile in a fresh compiler) and cached
  (the same spec again).
- Held out: the same coverage, compile time and validity (every compiled schema asked) on
  real schemas the folder does not hold (`heldout_schemas`: the chart's custom resources'
  and values' object schemas).
- Validity: `--validity` compiled schemas, taken round-robin over the subsets, each asked
  for greedily (a chat prompt naming the schema's title or file) with at most
  `--max-tokens` tokens, 16 at a time: the share that finished (the grammar completed)
  and, of those, the share `jsonschema` accepts.
- Throughput: decode tok/s of constrained requests at batch 1 and 16 (the first 16 valid
  schemas) against the same prompts unconstrained, at most `--decode-tokens` each, over
  the steps in which the whole batch decodes; medians over `--repeats`; constrained with
  the grammar masks filled on a thread beside the layers (as served) and, for comparison,
  before them. With `--qfirst` also on a Q-First attention service whose MLP pool replica
  serves over loopback gRPC (the Ray deployment's data path): validity of the same schemas
  (and how many outputs equal the embedded engine's), and throughput.

The engine is the embedded one at `--dtype auto` (this machine's serving dtype).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import torch

from bench.common import MODEL, ROOT
from kernels.sampling import SamplingParams
from services.cli.argtypes import DTYPES, resolve_dtype
from services.common.messages import GenerationParams, RequestError, StructuredSpec
from services.common.tokenizer import load_tokenizer
from services.deployment.build import EngineOptions, grammars_for
from services.deployment.server import embedded_engine

SCHEMAS = ROOT / "tests" / "data" / "jsonschemabench"


def load_schemas() -> list[tuple[str, str, str]]:
    """(subset, file name, schema text) of every non-empty schema file."""
    out = []
    for path in sorted(SCHEMAS.glob("*/*.json")):
        text = path.read_text()
        if text.strip():
            out.append((path.parent.name, path.name, text))
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def coverage(schemas, vocab_size: int):
    grammars = grammars_for(MODEL, vocab_size)
    compiled, refused, crashed, cold, warm = [], [], [], [], []
    for subset, name, text in schemas:
        spec = StructuredSpec("json_schema", text)
        start = time.perf_counter()
        try:
            grammar = grammars.compile(spec)
        except RequestError as exc:
            refused.append((subset, name, str(exc)[:120]))
            continue
        except Exception as exc:  # noqa: BLE001 — counted: the API would answer 500
            crashed.append((subset, name, f"{type(exc).__name__}: {exc}"[:120]))
            continue
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.compile(spec)
        warm.append(time.perf_counter() - start)
        compiled.append((subset, name, text, grammar))
    return compiled, refused, crashed, cold, warm


def prompt_ids(tok, name: str, schema: dict) -> list[int]:
    title = schema.get("title") or schema.get("description") or name.removesuffix(".json")
    ask = f"Give one example JSON object for: {str(title)[:200]}"
    text = tok.apply_chat_template([{"role": "user", "content": ask}],
                                   add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def round_robin(compiled, n: int):
    by_subset: dict[str, list] = {}
    for item in compiled:
        by_subset.setdefault(item[0], []).append(item)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_subset.values()):
        for items in by_subset.values():
            if i < len(items) and len(out) < n:
                out.append(items[i])
        i += 1
    return out


def generate(engine, jobs: list[tuple[list[int], GenerationParams]]):
    ids = [engine.add_request(p, params) for p, params in jobs]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    return [engine.pop(i) for i in ids], elapsed


def full_batch_rate(engine, jobs) -> float:
    """Decode tok/s over the steps in which every request of `jobs` decodes (after each
    has its first token, before any finished): a constrained request may finish early, and
    a shrinking batch would be slower per token for a reason that is not the masks."""
    ids = [engine.add_request(p, params) for p, params in jobs]
    tokens, seconds = 0, 0.0
    while engine.has_unfinished():
        live = [engine.seqs[i] for i in ids if not engine.seqs[i].finished]
        full = len(live) == len(ids) and all(s.output_ids for s in live)
        start = time.perf_counter()
        engine.step()
        if full:
            seconds += time.perf_counter() - start
            tokens += len(ids)
    for i in ids:
        engine.pop(i)
    return tokens / seconds if seconds else float("nan")


def report(engine, tok, label: str, schemas, asked: int, max_tokens: int):
    """Coverage, compile time and validity of one schema set (`asked` compiled schemas,
    round-robin over its subsets); returns (the schemas asked, their jobs, the valid jobs,
    the outputs)."""
    compiled, refused, crashed, cold, warm = coverage(schemas, engine.model.config.vocab_size)
    total = len(schemas)
    print(f"## {label}: {total} schemas, {len({s for s, _, _ in schemas})} subsets")
    print(f"coverage: compiled {len(compiled)}/{total} ({100 * len(compiled) / total:.1f}%), "
          f"refused with a 400 {len(refused)} ({100 * len(refused) / total:.1f}%), "
          f"crashed {len(crashed)}")
    for subset in sorted({s for s, _, _ in schemas}):
        n = sum(1 for s, _, _ in schemas if s == subset)
        c = sum(1 for s, *_ in compiled if s == subset)
        print(f"  {subset}: {c}/{n}")
    for subset, name, why in refused + crashed:
        print(f"  refused {subset}/{name}: {why}")
    print(f"compile ms, p50 / p99: cold {1e3 * pct(cold, .5):.2f} / {1e3 * pct(cold, .99):.2f}; "
          f"cached {1e3 * pct(warm, .5):.3f} / {1e3 * pct(warm, .99):.3f}")
    chosen = round_robin(compiled, asked)
    jobs = []
    for subset, name, text, grammar in chosen:
        spec = StructuredSpec("json_schema", text)
        jobs.append((prompt_ids(tok, name, json.loads(text)),
                     GenerationParams(max_tokens=max_tokens, structured=spec,
                                      sampling=SamplingParams(temperature=0.0))))
    return (chosen, jobs, *validity(engine, tok, chosen, jobs, max_tokens))


def validity(engine, tok, chosen, jobs, max_tokens: int):
    """Each schema of `chosen` asked greedily (16 at a time): the share that finished and,
    of those, the share `jsonschema` accepts. Returns (the valid jobs, each output)."""
    finished = valid = 0
    valid_jobs, failures, outputs = [], [], []
    for a in range(0, len(jobs), 16):
        seqs, _ = generate(engine, jobs[a:a + 16])
        for (subset, name, text, _), seq, job in zip(chosen[a:a + 16], seqs, jobs[a:a + 16]):
            outputs.append(seq.output_ids)
            if seq.finish_reason != "stop":
                continue
            finished += 1
            out = tok.decode(seq.output_ids, skip_special_tokens=True)
            try:
                schema = json.loads(text)     # not checked against the metaschema, whose
                # `format: regex` refuses Go's inline `(?i)` that Python's `re` reads
                jsonschema.validators.validator_for(schema)(schema).validate(json.loads(out))
                valid += 1
                valid_jobs.append(job)
            except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as exc:
                failures.append(f"{subset}/{name}: {type(exc).__name__}: {str(exc)[:100]}")
    print(f"validity: {len(jobs)} schemas asked, at most {max_tokens} tokens: finished "
          f"{finished}, valid {valid}/{finished} ({100 * valid / max(finished, 1):.1f}%)")
    for line in failures:
        print(f"  invalid {line}")
    return valid_jobs, outputs


def heldout_schemas(max_chars: int = 20_000) -> list[tuple[str, str, str]]:
    """Real schemas this benchmark's folder does not hold: the object schemas (and those of
    their properties and array items, two levels down, under `max_chars`) of the custom
    resources the chart renders (KubeRay's RayCluster, prometheus-operator's PodMonitor,
    ServiceMonitor and PrometheusRule: `k8s/crds/`) and of the chart's values
    (`values.schema.json`). Subsets: the resource's kind, and "values"."""
    import yaml

    out: list[tuple[str, str, str]] = []

    def walk(subset: str, name: str, schema, depth: int, definitions=None) -> None:
        if not isinstance(schema, dict):
            return
        text = json.dumps(schema)
        if definitions and depth and "#/definitions/" in text:    # the root's, referenced
            text = json.dumps({**schema, "definitions": definitions})
        if schema.get("type") == "object" and schema.get("properties") and len(text) < max_chars:
            out.append((subset, name, text))
        if depth < 2:
            for key, sub in (schema.get("properties") or {}).items():
                walk(subset, f"{name}.{key}", sub, depth + 1, definitions)
            walk(subset, f"{name}[]", schema.get("items"), depth + 1, definitions)

    for path in sorted((ROOT / "k8s" / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        kind = crd["spec"]["names"]["kind"]
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        walk(kind, kind, spec, 0)
    values = json.loads((ROOT / "k8s" / "splitstack" / "values.schema.json").read_text())
    walk("values", "values", values, 0, values.get("definitions"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validity", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--qfirst", action="store_true",
                    help="also measure throughput on a Q-First attention service")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype("auto", False)
    engine, _ = embedded_engine(MODEL, DTYPES[dtype], EngineOptions(kv_cache_bytes=1 << 30),
                                args.threads)
    tok = load_tokenizer(MODEL)
    print(f"# structured outputs; model {MODEL.name}, {dtype}")
    heldout = heldout_schemas()
    sets = {"JSONSchemaBench": report(engine, tok, "JSONSchemaBench", load_schemas(),
                                      args.validity, args.max_tokens),
            "held out": report(engine, tok, "held out (schemas of the chart's CRDs and values, "
                               "not in JSONSchemaBench)", heldout, len(heldout),
                               args.max_tokens)}
    _, jobs, valid_jobs, _ = sets["JSONSchemaBench"]
    pool = valid_jobs or jobs
    print(f"throughput: decode tok/s, {args.decode_tokens} tokens a request, median of "
          f"{args.repeats}; constrained with the masks filled beside the layers (as served) "
          f"and before them; embedded engine")
    throughput(engine, pool, args, {"unconstrained": "free", "beside": "json",
                                    "before": "json-first"})
    if args.qfirst:
        engine, server = qfirst(dtype, engine.model.config.vocab_size)
        try:
            print("## Q-First attention service, one MLP pool replica over loopback gRPC (the "
                  "Ray deployment's data path)")
            for label, (chosen, jobs, _, outputs) in sets.items():
                print(f"{label}, the same schemas asked:")
                _, got = validity(engine, tok, chosen, jobs, args.max_tokens)
                same = sum(a == b for a, b in zip(got, outputs))
                print(f"  outputs identical to the embedded engine's: {same}/{len(outputs)}")
            print("throughput: decode tok/s, as above; Q-First")
            throughput(engine, pool, args, {"unconstrained": "free", "beside": "json",
                                            "before": "json-first"})
        finally:
            server.stop(0)


def qfirst(dtype: str, vocab_size: int):
    """An attention service's engine in this process, its pool replica behind gRPC."""
    from models import load_model
    from services.attention.runner import qfirst_engine
    from services.common.tokenizer import eos_token_ids
    from services.deployment.transports import make_transport
    from services.mlp_pool import MLPPool
    from services.mlp_pool.grpc_server import serve_pool

    model = load_model(MODEL, dtype=DTYPES[dtype])
    server, address = serve_pool(MLPPool(model, "pool-0"))
    engine = qfirst_engine(model, make_transport("grpc", [address]), block_size=16,
                           kv_cache_bytes=1 << 30, eos_token_ids=eos_token_ids(MODEL),
                           grammars=grammars_for(MODEL, vocab_size))
    return engine, server


def throughput(engine, pool, args, columns: dict[str, str]) -> None:
    """One row per batch size: tok/s per column (kind "free": unconstrained, "json":
    constrained, "json-first": constrained with the masks filled before the layers), and
    each constrained column's ratio to the unconstrained one."""
    ratios = [c for c, kind in columns.items() if kind != "free"]
    print("| batch | " + " | ".join(columns) + " | " + " | ".join(f"{c} ratio" for c in ratios)
          + " |")
    print("|---" * (1 + len(columns) + len(ratios)) + "|")
    for batch in (1, 16):
        picked = [pool[i % len(pool)] for i in range(batch)]
        rates = {c: [] for c in columns}
        for _ in range(args.repeats):
            for column, kind in columns.items():
                batch_jobs = [(p, GenerationParams(
                    max_tokens=args.decode_tokens, ignore_eos=kind == "free",
                    structured=params.structured if kind != "free" else None,
                    sampling=SamplingParams(temperature=0.0))) for p, params in picked]
                engine.runner.__dict__.pop("defers_sampling", None)
                if kind == "json-first":         # this run only: the masks before the layers
                    engine.runner.defers_sampling = False
                rates[column].append(full_batch_rate(engine, batch_jobs))
                engine.runner.__dict__.pop("defers_sampling", None)
        med = {c: statistics.median(v) for c, v in rates.items()}
        free = med[next(c for c, k in columns.items() if k == "free")]
        print(f"| {batch} | " + " | ".join(f"{v:.1f}" for v in med.values()) + " | "
              + " | ".join(f"{med[c] / free:.2f}x" for c in ratios) + " |")

if __name__ == "__main__":
    main()
