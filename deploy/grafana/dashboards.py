"""The four splitstack dashboards (Overview, Pools, Prefix cache, RidgeFill) as code;
`deploy/grafana/generate.py` writes them to JSON.

Every query reads series of docs/metrics.md: the gateway's own, and in the Ray deployment
each member's (scraped where it runs, with the gateway's `job`), which carry a `member`
label (the replica's address). Tags say where a dashboard has data: `embedded`, `ray`."""
from __future__ import annotations

from deploy.grafana.panels import (Annotation, Panel, dashboard, heatmap_targets, increase,
                                   mean, quantile, quantile_targets, rate, sel, zero_if_none)

FINISHED = "splitstack_requests_finished_total"
HTTP = "splitstack_http_requests_total"
API = 'route=~"/v1/.*|/tokenize|/detokenize"'     # the routes the availability objective holds


def slo(record: str, objective: str, window: str) -> str:
    """A recording rule of deploy/prometheus/rules/recording.yml for one objective, per
    deployment."""
    matcher = f'slo="{objective}"'
    return f"max by (job) (job:splitstack_slo_{record}{window}{sel(matcher)})"


def within(objective: str, window: str = "5m") -> str:
    """Share of events within `objective` over `window` (the alerts' windows)."""
    return f"1 - {slo('errors:ratio_rate', objective, window)}"


def burn(objective: str, window: str) -> str:
    """Error-budget burn rate: 1 spends the 30-day budget in 30 days."""
    return (f"{slo('errors:ratio_rate', objective, window)} / "
            f"{slo('error_budget:ratio', objective, '')}")
TOKS = "suffix: tokens/s"
# The Ray deployment's events, marked on the Overview's and the Pools' time panels: a pool
# resized, requests moved off an attention service, members draining. (Each mark is a
# minute in which the event happened; an embedded deployment has none.)
EVENTS = (
    Annotation("Scale events", f"sum by (pool, direction, reason) (increase("
               f"splitstack_scale_events_total{sel()}[1m])) > 0", "blue",
               "{{pool}} scaled {{direction}} ({{reason}})", ("pool", "reason")),
    Annotation("Migrations", f"sum by (reason) (increase(splitstack_migrations_total"
               f"{sel()}[1m])) > 0", "orange", "{{reason}}: requests moved to another "
               "attention service", ("reason",)),
    Annotation("Drains", "sum by (pool) (splitstack_pool_replicas"
               + sel('state="draining"') + ") > 0", "purple", "{{pool}} members draining", ("pool",)),
)
# latency percentiles per deployment: with several selected ("All"), one line each rather
# than one percentile over all of them
PER_JOB = ("job",)


def overview() -> dict:
    error_ratio = (rate(FINISHED, extra='reason="error"', window="5m") + " / "
                   + rate(FINISHED, window="5m"))
    return dashboard("splitstack-overview", "splitstack / Overview",
                     "Requests, latency, tokens and load of one splitstack deployment, as its "
                     "clients see it (the gateway's series).", ["embedded", "ray"], [
        ("Objectives", [
            Panel("Availability (5m)", "percentunit", "Share of API requests answered "
                  "without a 5xx over the last 5 minutes (503 refusals count as errors), the "
                  "short window of the SplitstackAvailability*Burn alerts.",
                  [(within("availability"), "{{job}}")], kind="stat", width=6,
                  height=4),
            Panel("TTFT within objective (5m)", "percentunit", "Share of first tokens within "
                  "the TTFT objective the gateway exports (splitstack_slo_objective_seconds) "
                  "over the last 5 minutes.",
                  [(within("time_to_first_token"), "{{job}}")], kind="stat", width=6,
                  height=4),
            Panel("Error budget burn rate (1h)", "none", "How fast each objective's error "
                  "budget burns over the last hour: 1 spends a 30-day budget in 30 days; "
                  "the page fires from 14.4 (with the 5-minute rate over it too), red here.",
                  [(burn(o, "1h"), "{{job}} " + o) for o in ("availability", "time_to_first_token",
                                               "inter_token_latency")],
                  kind="stat", width=6, height=4, red_from=14.4),
            Panel("Error budget left (3 days)", "percentunit", "Share of each objective's "
                  "error budget the last 3 days left unspent (1 - burn rate over 3 days; "
                  "below 0 the objective was missed over them).",
                  [(f"1 - {burn(o, '3d')}", "{{job}} " + o) for o in ("availability",
                                                        "time_to_first_token")],
                  kind="stat", width=6, height=4),
        ]),
        ("Now", [
            Panel("Request rate", "reqps", "Requests finished per second, any outcome, "
                  "over 5 minutes.",
                  [(rate(FINISHED, window="5m"), "requests/s")], kind="stat", width=6,
                  height=4),
            Panel("Error ratio", "percentunit", "Share of finished requests that failed "
                  "(finish reason error) over 5 minutes; red from 5%, the "
                  "SplitstackHighErrorRatio alert's threshold.", [(error_ratio, "errors")],
                  kind="stat", width=6, height=4, red_from=0.05),
            Panel("TTFT p95", "s", "95th percentile of the time from a request's arrival "
                  "to its first token over 5 minutes; the objective is a share of requests "
                  "within a bound (the Objectives row).",
                  [(quantile(0.95, "splitstack_time_to_first_token_seconds", PER_JOB,
                             window="5m"), "{{job}}")], kind="stat", width=6, height=4),
            Panel("Running", "short", "Requests the engines schedule now (prefilling or "
                  "decoding).",
                  [(f"sum(splitstack_requests_running{sel()})", "running")], kind="stat",
                  width=6, height=4),
        ]),
        ("Requests", [
            Panel("Request rate by finish reason", "reqps", "Finished requests per second "
                  "by reason: stop (EOS, stop id or string), length (max_tokens or the "
                  "context), abort (client gone or cancelled), error.",
                  [(rate(FINISHED, ("reason",)), "{{reason}}")], stack=True, width=8),
            Panel("Errors and aborts", "percentunit", "Share of finished requests that "
                  "failed (error) or were aborted (the client left or cancelled).",
                  [(f'{rate(FINISHED, extra=x)} / {rate(FINISHED)}', legend)
                   for x, legend in (('reason="error"', "error"),
                                     ('reason="abort"', "abort"))], width=8),
            Panel("Refused before any work", "reqps", "Requests and connections the gateway "
                  "refused per second, by reason: body_too_large, body_timeout, "
                  "header_timeout, too_many_connections, queue_full (503), rate_limited "
                  "(429), draining; 0 while there were none.",
                  [(zero_if_none(rate("splitstack_http_refusals_total", ("reason",)),
                                 f"sum(splitstack_requests_running{sel()})", "reason"),
                    "{{reason}}")], width=8),
            Panel("API responses by status code", "reqps", "Responses to the API routes per "
                  "second by HTTP status code, refusals included (what the availability "
                  "objective counts: 5xx are errors).",
                  [(rate(HTTP, ("code",), extra=API), "{{code}}")], stack=True, width=24),
        ]),
        ("Latency", [
            Panel("Time to first token", "s", "TTFT percentiles: arrival to first token "
                  "(queue, prefill and the first sampling), and the objective the gateway "
                  "exports (splitstack_slo_objective_seconds).",
                  quantile_targets("splitstack_time_to_first_token_seconds", PER_JOB, "{{job}} ")
                  + [("max(splitstack_slo_objective_seconds"
                      + sel('slo="time_to_first_token"') + ")", "objective")], width=8),
            Panel("Inter-token latency", "s", "ITL percentiles: time between consecutive "
                  "tokens of a request.",
                  quantile_targets("splitstack_inter_token_latency_seconds", PER_JOB, "{{job}} "), width=8),
            Panel("End-to-end latency", "s", "E2E percentiles: arrival to last token.",
                  quantile_targets("splitstack_e2e_request_latency_seconds", PER_JOB, "{{job}} "), width=8),
            Panel("Time to first token, every request", "s", "First tokens per second in "
                  "each TTFT bucket: the whole distribution, where percentiles hide a second "
                  "mode (the TTFT objective is one of the bucket bounds).",
                  heatmap_targets("splitstack_time_to_first_token_seconds"), kind="heatmap",
                  width=12),
            Panel("Inter-token latency, every token", "s", "Token gaps per second in each "
                  "ITL bucket.", heatmap_targets("splitstack_inter_token_latency_seconds"),
                  kind="heatmap", width=12),
            Panel("Queue time", "s", "Percentiles of the time a request waited in the "
                  "engine's queue before it was first scheduled.",
                  quantile_targets("splitstack_request_queue_time_seconds", PER_JOB, "{{job}} "), width=8),
            Panel("Prefill time", "s", "Percentiles of the time from a request's first "
                  "scheduling to its first token.",
                  quantile_targets("splitstack_request_prefill_time_seconds", PER_JOB, "{{job}} "), width=8),
            Panel("Decode time", "s", "Percentiles of the time from a request's first token "
                  "to its last.",
                  quantile_targets("splitstack_request_decode_time_seconds", PER_JOB, "{{job}} "), width=8),
        ]),
        ("Throughput and load", [
            Panel("Tokens per second", TOKS, "Prompt tokens admitted and tokens generated "
                  "per second.",
                  [(rate("splitstack_prompt_tokens_total"), "prompt"),
                   (rate("splitstack_generation_tokens_total"), "generation")], width=8),
            Panel("Running and waiting", "short", "Requests the engines schedule (running: "
                  "prefilling or decoding) and requests in their queues, not yet scheduled "
                  "(waiting).",
                  [(f"sum(splitstack_requests_running{sel()})", "running"),
                   (f"sum(splitstack_requests_waiting{sel()})", "waiting")], width=8),
            Panel("KV cache usage", "percentunit", "Fraction of KV blocks in use (in the "
                  "Ray deployment: the fullest attention service).",
                  [(f"max(splitstack_kv_cache_usage_ratio{sel()})", "usage")], width=8,
                  max=1),
        ]),
        ("Engine", [
            Panel("Preemptions", "ops", "Sequences preempted per second: their KV freed for "
                  "older ones and computed again later (KV too small for the load).",
                  [(rate("splitstack_num_preemptions_total"), "preemptions/s")], width=8),
            Panel("Tokens per step", "short", "Tokens an engine step computes (decode rows "
                  "and prefill chunk rows): mean and p95.",
                  [(mean("splitstack_iteration_tokens"), "mean"),
                   (quantile(0.95, "splitstack_iteration_tokens"), "p95")], width=8),
            Panel("Request lengths", "short", "Prompt and generated tokens per request "
                  "(p50, p95), observed when a request ends.",
                  [(quantile(q, f"splitstack_request_{kind}_tokens"),
                    f"{kind} p{round(q * 100)}") for kind in ("prompt", "generation")
                   for q in (0.5, 0.95)], width=8),
        ]),
    ], EVENTS)


def pools() -> dict:
    return dashboard("splitstack-pools", "splitstack / Pools",
                     "The Ray deployment's pools: members per state, scale events and "
                     "migrations; per attention service KV and queue; per MLP pool replica "
                     "stage latency and batch size; per prefill replica queue and time. "
                     "`member` in a legend is the replica's address.", ["ray"], [
        ("Replicas", [
            Panel("Replicas per pool and state", "short", "Members of each pool (attention, "
                  "mlp, prefill) by state: pending (waiting for a free resource), starting, "
                  "ready (in routing), draining.",
                  [("sum by (pool, state) (splitstack_pool_replicas" + sel() + ")",
                    "{{pool}} {{state}}")], stack=True, width=8),
            Panel("Scale events", "short", "Changes of a pool's desired size over the "
                  "window, by direction and reason (admin, autoscale); 0 per pool "
                  "while there were none.",
                  [(zero_if_none(increase("splitstack_scale_events_total",
                                          ("pool", "direction", "reason")),
                                 "sum by (pool) (splitstack_pool_replicas" + sel() + ")",
                                 "direction"),
                    "{{pool}} {{direction}} {{reason}}")], width=8),
            Panel("Members answering", "short", "1 while a member answers its health or "
                  "stats call, else 0, per attention service, pool and prefill replica.",
                  [('{__name__=~"splitstack_(attention|pool|prefill)_up", ' + sel()[1:],
                    "{{__name__}} {{member}}")], width=8, max=1),
            Panel("Migrations", "short", "Requests moved to another attention service and "
                  "continued there over the window, by reason: failure (their service "
                  "died) or drain (it was stopped while busy).",
                  [(increase("splitstack_migrations_total", ("reason",)), "{{reason}}")]),
            Panel("Migration pause", "s", "Percentiles of a migrated request's gap from its "
                  "last token before the move to its first token after it.",
                  quantile_targets("splitstack_migration_pause_seconds")),
        ]),
        ("Attention services", [
            Panel("KV cache usage per service", "percentunit", "Fraction of KV blocks in use "
                  "on each attention service (its fullest shard).",
                  [("max by (member) (splitstack_attention_kv_cache_usage_ratio"
                    + sel() + ")", "{{member}}")], width=8, max=1),
            Panel("Running and waiting per service", "short", "Requests decoding on each "
                  "attention service, and requests waiting there for KV.",
                  [("sum by (member) (splitstack_attention_requests_running" + sel() + ")",
                    "running {{member}}"),
                   ("sum by (member) (splitstack_attention_requests_waiting" + sel() + ")",
                    "waiting {{member}}")], width=8),
            Panel("Retries per service", "cps", "Pool calls each attention service made "
                  "again on another pool replica, and prefill calls made again on another "
                  "prefill replica, per second.",
                  [(rate("splitstack_attention_pool_retries_total", ("member",)),
                    "pool {{member}}"),
                   (rate("splitstack_attention_prefill_retries_total", ("member",)),
                    "prefill {{member}}")], width=8),
        ]),
        ("MLP pool replicas", [
            Panel("Stage latency p95 per replica", "s", "95th percentile of one batched "
                  "pool forward's compute time, per replica and kind (stage: a layer's "
                  "feed-forward; final: the head and sampling; score: prompt log-probs).",
                  [(quantile(0.95, "splitstack_pool_stage_seconds", ("member", "kind")),
                    "{{member}} {{kind}}")], width=8),
            Panel("Batch rows per replica", "short", "Rows in one batched pool forward per "
                  "replica: the mean and the 95th percentile.",
                  [(mean("splitstack_pool_batch_rows", ("member",)), "mean {{member}}"),
                   (quantile(0.95, "splitstack_pool_batch_rows", ("member",)),
                    "p95 {{member}}")], width=8),
            Panel("Forwards per replica", "ops", "Batched forwards per second per replica "
                  "and kind, and forwards that raised (their callers retried elsewhere).",
                  [(rate("splitstack_pool_stage_seconds_count", ("member", "kind")),
                    "{{member}} {{kind}}"),
                   (rate("splitstack_pool_failed_forwards_total", ("member",)),
                    "failed {{member}}")], width=8),
        ]),
        ("Prefill replicas", [
            Panel("Prefill calls in flight per replica", "short", "Mean number of prefill "
                  "calls queued or running on each replica over the window (Little's law: "
                  "the rate of the summed call time).",
                  [(rate("splitstack_prefill_request_seconds_sum", ("member",)),
                    "{{member}}")], width=8),
            Panel("Prefill time per replica", "s", "Percentiles of a prefill call's time on "
                  "each replica by mode (exact, ridgefill), from its arrival to its prompt's "
                  "KV being ready (queue and compute), and of streaming that KV to the "
                  "attention service (p95).",
                  [(quantile(q, "splitstack_prefill_request_seconds", ("member", "mode")),
                    f"{{{{mode}}}} p{round(q * 100)} {{{{member}}}}") for q in (0.5, 0.95)]
                  + [(quantile(0.95, "splitstack_prefill_send_seconds", ("member",)),
                      "send p95 {{member}}")], width=8),
            Panel("Prompt tokens prefilled per replica", TOKS, "Prompt tokens each prefill "
                  "replica prefilled per second.",
                  [(rate("splitstack_prefill_prompt_tokens_total", ("member",)),
                    "{{member}}")], width=8),
        ]),
    ], EVENTS)


def prefix_cache() -> dict:
    cache = "splitstack_prefix_cache_"
    present = "sum by (member) (" + cache + "memory_bytes" + sel() + ")"
    return dashboard("splitstack-prefix-cache", "splitstack / Prefix cache",
                     "The Tail-Replay prefix cache (serve --prefix-cache): hits per tier, "
                     "the replay and transfer of a hit, the memory tier and tier errors. In "
                     "the Ray deployment it runs on the prefill replicas (`member`).",
                     ["embedded", "ray"], [
        ("Hits", [
            Panel("Hit ratio per tier", "percentunit", "Share of looked-up prompt tokens "
                  "served from the cache, by the tier their block came from (memory, redis).",
                  [(rate(cache + "hit_tokens_total", ("member", "tier"))
                    + " / on (member) group_left "
                    + rate(cache + "query_tokens_total", ("member",)),
                    "{{tier}} {{member}}")], max=1),
            Panel("Looked-up and hit tokens", TOKS, "Prompt tokens looked up, and served "
                  "from each tier, per second.",
                  [(rate(cache + "query_tokens_total", ("member",)), "looked up {{member}}"),
                   (rate(cache + "hit_tokens_total", ("member", "tier")),
                    "hit {{tier}} {{member}}")]),
        ]),
        ("Hit cost", [
            Panel("Tail replay time", "s", "Percentiles of the tail replay that rebuilds a "
                  "hit's linear-attention (Gated DeltaNet) states.",
                  quantile_targets(cache + "replay_seconds")),
            Panel("KV transfer time", "s", "Percentiles of the host-to-device transfer of a "
                  "hit's full-attention KV.", quantile_targets(cache + "transfer_seconds")),
        ]),
        ("Storage", [
            Panel("Memory tier", "bytes", "Payload bytes held in the memory tier, and its "
                  "capacity.",
                  [(present, "used {{member}}"),
                   ("sum by (member) (" + cache + "memory_capacity_bytes" + sel() + ")",
                    "capacity {{member}}")], width=8),
            Panel("Stored and skipped tokens", TOKS, "Tokens newly stored per tier, and "
                  "tokens not stored in memory for want of room beside pinned blocks, per "
                  "second.",
                  [(rate(cache + "inserted_tokens_total", ("member", "tier")),
                    "stored {{tier}} {{member}}"),
                   (rate(cache + "skipped_tokens_total", ("member",)),
                    "skipped {{member}}")], width=8),
            Panel("Evictions", "suffix: blocks/s", "Blocks evicted from the memory tier per "
                  "second.", [(rate(cache + "evictions_total", ("member",)), "{{member}}")],
                  width=8),
            Panel("Tier errors", "cps", "Tier failures degraded to a miss, per second, by "
                  "tier and kind (unavailable, timeout, corrupt); 0 while there were none.",
                  [(zero_if_none(rate(cache + "errors_total", ("member", "tier", "kind")),
                                 present, "kind"), "{{tier}} {{kind}} {{member}}")],
                  width=24),
        ]),
    ])


def ridgefill() -> dict:
    filled = "splitstack_ridgefill_filled_rows_total"
    exact = "splitstack_ridgefill_exact_rows_total"
    ridge, every = "splitstack_prefill_seconds", "splitstack_request_prefill_time_seconds"
    return dashboard("splitstack-ridgefill", "splitstack / RidgeFill",
                     "RidgeFill prefill (serve --maps, requests with prefill_mode "
                     "ridgefill): prompt rows whose upper layers were filled by the ridge "
                     "map against rows run through every layer, and prefill time by mode.",
                     ["embedded", "ray"], [
        ("Rows", [
            Panel("Filled and exact rows", "suffix: rows/s", "RidgeFill prompt rows per "
                  "second: filled (upper layers from the ridge map) and exact (the tail and "
                  "the selected rows, every layer).",
                  [(rate(filled, ("member",)), "filled {{member}}"),
                   (rate(exact, ("member",)), "exact {{member}}")], stack=True),
            Panel("Filled share", "percentunit", "Share of RidgeFill prompt rows whose upper "
                  "layers were filled.",
                  [(f"{rate(filled, ('member',))} / ({rate(filled, ('member',))} + "
                    f"{rate(exact, ('member',))})", "{{member}}")], max=1),
        ]),
        ("Prefill time by mode", [
            Panel("Prefill time by mode", "s", "Percentiles of the prefill of RidgeFill "
                  "prompts (the prefill service's compute per prompt) beside the prefill "
                  "time of every request (first scheduling to first token, exact and "
                  "RidgeFill); in the Ray deployment also a prefill replica's time per call "
                  "by mode (queue and compute).",
                  [(quantile(q, ridge), f"ridgefill p{round(q * 100)}") for q in (0.5, 0.95)]
                  + [(quantile(q, every), f"all requests p{round(q * 100)}")
                     for q in (0.5, 0.95)]
                  + [(quantile(0.95, "splitstack_prefill_request_seconds", ("mode",)),
                      "{{mode}} p95 (prefill replicas)")]),
            Panel("RidgeFill prompts", "reqps", "Prompts prefilled with RidgeFill per "
                  "second.", [(rate(ridge + "_count", ("member",)), "{{member}}")]),
        ]),
    ])


DASHBOARDS = {"overview.json": overview, "pools.json": pools,
              "prefix-cache.json": prefix_cache, "ridgefill.json": ridgefill}
