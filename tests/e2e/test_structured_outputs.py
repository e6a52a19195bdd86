"""Structured outputs over real HTTP with the official `openai` client, on the embedded
deployment (the engine on a thread and in its own process) and on the Ray deployment (an
attention service and an MLP pool replica over gRPC, the grammar's masks travelling to the
pool): `beta.chat.completions.parse` with a pydantic model, a
streamed json_schema answer equal to the whole one, vLLM's structured_outputs, and 400s
naming the field for what cannot be compiled."""
from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.deployment.server import build_embedded
from tests.helpers.gateway import (MODEL, ZOO, client, deployment_metrics, ray_deployment,
                                   running)

pytestmark = pytest.mark.slow


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    capital: bool


@pytest.fixture(scope="module", params=["thread", "process", "ray"])
def base(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
        with ray_deployment() as url:
            yield url
        return
    app = build_embedded(ZOO, kv_cache_bytes=64 << 20, threads=1,
                         engine_process=request.param == "process")
    with running(app) as url:
        yield url


ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


def test_parse_returns_the_pydantic_object(base):
    r = client(base).beta.chat.completions.parse(model=MODEL, messages=ASK, response_format=City,
                                                 max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_the_engine_that_runs_the_grammars_counts_them(base):
    """Constrained requests, their compile times and the step's mask times are exported by
    the engine that runs the grammars: the gateway's (re-exported from the engine's
    process) or, on Ray, the attention service's own endpoint."""
    def counts() -> tuple[float, float, float]:
        text = deployment_metrics(base)
        return tuple(sum(s.value for fam in text_string_to_metric_families(text)
                         for s in fam.samples if s.name == name and labels.items() <= s.labels.items())
                     for name, labels in (
                         ("splitstack_structured_requests_total", {"kind": "json_schema"}),
                         ("splitstack_grammar_compile_seconds_count", {}),
                         ("splitstack_grammar_mask_seconds_count", {})))
    before = counts()
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": {
        "type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}}}
    client(base).chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                         temperature=0, response_format=fmt)
    after = counts()
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1
    assert after[2] > before[2]                       # at least one step filled its mask


def test_a_streamed_answer_equals_the_whole_one(base):
    fmt = {"type": "json_schema", "json_schema": {"name": "city",
                                                  "schema": City.model_json_schema()}}
    c = client(base)
    whole = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                      response_format=fmt).choices[0].message.content
    chunks = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                       temperature=0, response_format=fmt, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), City.model_json_schema())


def test_structured_outputs_choice_and_regex(base):
    c = client(base)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Sky blue?"}],
                                  max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = c.completions.create(model=MODEL, prompt="My phone number is", max_tokens=12,
                             temperature=0, extra_body={"structured_outputs":
                                                        {"regex": r" [0-9]{3}-[0-9]{4}"}})
    text = r.choices[0].text
    assert len(text) == 9 and text[4] == "-" and text.replace("-", "").strip().isdigit()


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
])
def test_what_cannot_compile_is_a_400_naming_the_field(base, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client(base).chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                             extra_body=extra)
    assert err.value.body["param"] == param
    assert "cannot be compiled" in err.value.body["message"]
