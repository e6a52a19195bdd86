"""RidgeFill through the gateway: per-request `prefill_mode` / `ridgefill`, 400s, metrics."""
from __future__ import annotations

import httpx
import pytest

from evals.corpus import documents
from services.common.tokenizer import load_tokenizer
from services.deployment.build import EngineOptions
from services.deployment.ray_cluster import ClusterConfig
from services.deployment.server import build_cluster, build_embedded
from tools.calibration import CalibConfig, calibrate
from services.prefill.service import PrefillConfig
from tests.helpers.gateway import ZOO, fresh_metrics, running

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def maps(tmp_path_factory):
    from models import load_model

    out = tmp_path_factory.mktemp("maps")
    tok = load_tokenizer(ZOO)
    docs = (tok(d.text, add_special_tokens=False)["input_ids"] for d in documents("calib")[:5])
    calibrate(load_model(ZOO), docs, CalibConfig(splits=(15,), max_len=256, heldout_docs=1),
              out, log=lambda *_: None)
    return out


def settings(maps) -> PrefillConfig:
    return PrefillConfig(maps_dir=str(maps), split=15, tail=32)


@pytest.fixture(scope="module")
def rf_server(maps):
    app = build_embedded(ZOO, served_name=MODEL, prefill=settings(maps))
    with running(app) as base:
        yield base, app.state.gateway


def complete(base, prompt, **extra):
    return httpx.post(base + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})


PROMPT = " ".join(documents("eval")[0].text.split()[:200]) + "\nIn short,"


def counter(base, name):
    lines = httpx.get(base + "/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " "))


def test_ridgefill_request_fills_rows_and_answers(rf_server):
    base, gateway = rf_server
    filled0 = counter(base, "splitstack_ridgefill_filled_rows_total")
    exact0 = counter(base, "splitstack_ridgefill_exact_rows_total")
    resp = complete(base, PROMPT, prefill_mode="ridgefill")
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"]
    n = resp.json()["usage"]["prompt_tokens"]
    # the tail and the 4 sink rows the maps were calibrated without run exact
    assert counter(base, "splitstack_ridgefill_filled_rows_total") - filled0 == n - 32 - 4
    assert counter(base, "splitstack_ridgefill_exact_rows_total") - exact0 == 32 + 4
    eng = gateway.backend.engine
    assert eng.blocks.num_free == eng.blocks.num_blocks


NEEDLE_PROMPT = ("The special magic number for harbor is: 4921337. Remember it. 4921337 is the "
                 "special magic number for harbor. " + " ".join(
                     documents("eval")[1].text.split()[:150])
                 + "\nWhat is the special magic number for harbor?\nThe special magic number "
                 "for harbor is")


def test_probe_request_takes_the_lexical_nets_rows(rf_server):
    """The server builds the lexicon from the model's tokenizer: a probe request computes
    the needle's sentences exactly within its budget (`lexical`: their share of it)."""
    base, gateway = rf_server
    service = gateway.backend.engine.prefill_service
    assert service.lexicon is not None
    seen = []
    real = type(service)._fill

    def spy(self, s):
        fill = real(self, s)
        run = fill.prefill

        def prefill(ids, s_, n_logits=1, **kw):
            res = run(ids, s_, n_logits, **kw)
            seen.append((list(ids), res.exact_rows.tolist(), s_))
            return res
        fill.prefill = prefill
        return fill
    type(service)._fill = spy
    try:
        for lexical in (0.15, 0.0):
            resp = complete(base, NEEDLE_PROMPT, prefill_mode="ridgefill",
                            ridgefill={"selector": "probe", "budget": 0.2, "lexical": lexical})
            assert resp.status_code == 200, resp.text
    finally:
        type(service)._fill = real
    (ids, with_net, s), (_, without, s0) = seen
    assert (s.lexical, s0.lexical) == (0.15, 0.0)
    p = len(ids) - s.tail
    nominated = service.lexicon.net(ids, p, int(round(0.15 * p)))
    assert len(nominated) >= 20                       # the two needle sentences
    assert set(nominated) <= set(with_net)
    for rows in (with_net, without):                  # the budget, plus the 4 sink rows
        assert s.budget_rows(p) <= sum(r < p for r in rows) <= s.budget_rows(p) + 4


def test_disabled_fill_equals_exact_mode(rf_server):
    base, _ = rf_server
    exact = complete(base, PROMPT).json()["choices"][0]["text"]
    off = complete(base, PROMPT, prefill_mode="ridgefill", ridgefill={"tail": 100000})
    assert off.status_code == 200 and off.json()["choices"][0]["text"] == exact


def test_log_probs_of_a_filled_prompt(rf_server):
    """A RidgeFill request's tokens report log-probs like any other (the first token's come
    from the fill's logits: with the fill disabled they are exact mode's); the prompt's
    own log-probs need every prompt row computed, so `echo` with `logprobs` is refused."""
    base, gateway = rf_server
    exact = complete(base, PROMPT, logprobs=3).json()["choices"][0]["logprobs"]
    off = complete(base, PROMPT, logprobs=3, prefill_mode="ridgefill",
                   ridgefill={"tail": 100000}).json()["choices"][0]["logprobs"]
    # the same tokens; the prompt runs in one pass instead of the engine's chunks, so the
    # BLAS kernels may round differently (not bitwise on every CPU)
    assert off["tokens"] == exact["tokens"] and len(exact["tokens"]) == 8
    assert [list(t) for t in off["top_logprobs"]] == [list(t) for t in exact["top_logprobs"]]
    pairs = zip(off["token_logprobs"] + [v for t in off["top_logprobs"] for v in t.values()],
                exact["token_logprobs"] + [v for t in exact["top_logprobs"] for v in t.values()])
    assert max(abs(a - b) for a, b in pairs) < 1e-4
    filled = complete(base, PROMPT, logprobs=3, prefill_mode="ridgefill").json()
    lp = filled["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == filled["usage"]["completion_tokens"]
    assert all(len(top) >= 3 for top in lp["top_logprobs"])
    refused = complete(base, PROMPT, logprobs=1, echo=True, prefill_mode="ridgefill")
    assert refused.status_code == 400 and "exact prefill" in refused.json()["error"]["message"]
    assert complete(base, PROMPT, logprobs=1, echo=True).status_code == 200   # exact mode
    eng = gateway.backend.engine
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("extra, needle", [
    ({"prefill_mode": "ridgefill", "ridgefill": {"split": 0}}, "split"),
    ({"prefill_mode": "ridgefill", "ridgefill": {"selector": "psychic"}}, "selector"),
    ({"prefill_mode": "ridgefill", "ridgefill": {"budget": 2}}, "budget"),
    ({"prefill_mode": "ridgefill", "ridgefill": {"selector": "probe", "lexical": -1}},
     "lexical"),
    ({"prefill_mode": "ridgefill", "ridgefill": {"split": 3}}, "no maps for split 3"),
    ({"prefill_mode": "ridgefill", "ridgefill": {"budget": "0.1"}}, "budget"),
    ({"prefill_mode": "ridgefill", "ridgefill": {"seed": None}}, "seed"),
    ({"prefill_mode": "ridgefill", "ridgefill": {"terminal_correction": "yes"}},
     "terminal_correction"),
    ({"prefill_mode": "fast"}, "prefill_mode"),
])
def test_bad_ridgefill_settings_are_400(rf_server, extra, needle):
    base, gateway = rf_server
    resp = complete(base, PROMPT, **extra)
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]
    assert not gateway.backend.engine.has_unfinished()


def test_the_ray_deployment_fills_as_the_embedded_engine(rf_server, maps, ray_session):
    """RidgeFill under the Q-First runner: an attention service holding the whole model
    (--transport local, no prefill replica) prefills with its own RidgeFill service into its
    KV shards; the tokens, log-probs and refusals are the embedded engine's."""
    config = ClusterConfig(model=str(ZOO), attention_shards=1, kv_splits=2,
                           transport="local", kv_cache_bytes=64 << 20, max_num_seqs=4,
                           prefill=EngineOptions(max_num_seqs=4, prefill=settings(maps)))
    app, cluster = build_cluster(config, served_name=MODEL)
    try:
        with running(app) as ray_base:
            for extra in ({"prefill_mode": "ridgefill"},
                          {"prefill_mode": "ridgefill", "ridgefill": {"selector": "probe"}}):
                want, got = (complete(b, PROMPT, logprobs=2, **extra).json()
                             for b in (rf_server[0], ray_base))
                assert got["choices"][0]["text"] == want["choices"][0]["text"]
                pairs = zip(got["choices"][0]["logprobs"]["token_logprobs"],
                            want["choices"][0]["logprobs"]["token_logprobs"])
                assert max(abs(a - b) for a, b in pairs) < 1e-3
            refused = complete(ray_base, PROMPT, prefill_mode="ridgefill",
                               ridgefill={"split": 3})
            assert refused.status_code == 400
            assert "no maps for split 3" in refused.json()["error"]["message"]
            text = fresh_metrics(ray_base)
            assert "splitstack_ridgefill_filled_rows_total" in text
        free, total = ray_session.get(cluster.attention[0].blocks.remote())
        assert free == total
    finally:
        cluster.shutdown()
