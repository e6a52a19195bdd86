"""The loadtest scenarios as a Locust user, for those who prefer Locust's web UI or its CSV
statistics:

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 [--scenario mix]
    locust -f loadtest/locustfile.py --host URL --headless -u 4 -r 4 -t 60s --csv out/run

Every request is streamed. Locust's table gets two rows per request kind: `POST <kind>`,
the end-to-end latency (until `[DONE]`), and `TTFT <kind>`, the time to the first
generated chunk. A request fails on a non-200 answer, an error event or a stream without
`[DONE]`. Prompts are the scenarios' (`loadtest/scenarios.py`), each user drawing its own
from its own seed; their lengths are estimated without the server's tokenizer (the `long`
scenario's prompts come out a little under their target)."""
from __future__ import annotations

import itertools
import json
import os
import time

from locust import HttpUser, constant, events, task

from loadtest.scenarios import SCENARIOS, ScenarioConfig, build_requests, estimate_tokens

_users = itertools.count()


@events.init_command_line_parser.add_listener
def _options(parser):
    parser.add_argument("--scenario", choices=SCENARIOS, default="chat",
                        help="the loadtest scenario (default: chat)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="output tokens per request (default: the scenario's)")
    parser.add_argument("--reuse-ratio", type=float, default=0.75,
                        help="shared-prefix: the shared share of each prompt")
    parser.add_argument("--api-key", default=os.environ.get("SPLITSTACK_API_KEY", ""),
                        help="Bearer token (default: $SPLITSTACK_API_KEY)")


class ChatUser(HttpUser):
    wait_time = constant(0)

    def on_start(self):
        opts = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        with self.client.get("/v1/models", headers=self.headers, name="/v1/models",
                             catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                raise RuntimeError(f"/v1/models answered {r.status_code}")
            card = r.json()["data"][0]
        self.model = card["id"]
        cfg = ScenarioConfig(name=opts.scenario, num_requests=64, seed=next(_users),
                             max_model_len=int(card.get("max_model_len") or 8192),
                             max_tokens=opts.max_tokens or None, reuse_ratio=opts.reuse_ratio)
        self.specs = itertools.cycle(build_requests(cfg, estimate_tokens))

    @task
    def generate(self):
        spec = next(self.specs)
        body = {**spec.body, "model": self.model, "stream": True}
        start = time.perf_counter()
        ttft = None
        with self.client.post(spec.path, json=body, headers=self.headers, stream=True,
                              name=spec.kind, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            done = False
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    r.failure(f"stream error: {event['error']}")
                    return
                choices = event.get("choices")
                if ttft is None and choices and "role" not in (choices[0].get("delta") or {}):
                    ttft = time.perf_counter() - start
            # Locust timed the headers; the request's latency is the whole stream
            r.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            if not done:
                r.failure("stream ended without [DONE]")
                return
            r.success()
        if ttft is not None:
            events.request.fire(request_type="TTFT", name=spec.kind, response_time=ttft * 1000,
                                response_length=0, exception=None, context={})
