"""Structured outputs (`services.engine.structured`): request forms, the engine's grammar-
constrained decoding on the real model, and refusals that name their field."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from kernels.sampling import History, SamplingParams, apply_masks, unpack_bitmask
from services.common.messages import GenerationParams, RequestError, StructuredSpec
from services.common.tokenizer import eos_token_ids, load_tokenizer
from services.engine import EngineConfig, LLMEngine
from services.engine.structured import Grammars
from services.gateway.protocol import APIError, ChatCompletionRequest
from tests.helpers.gateway import ZOO

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "jsonschemabench"
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "capital"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "capital": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ZOO)


@pytest.fixture(scope="module")
def engine(model_fp32, tok):
    grammars = Grammars(lambda: tok, model_fp32.config.vocab_size, eos_token_ids(ZOO))
    return LLMEngine(model_fp32, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8),
                     eos_token_ids=eos_token_ids(ZOO), grammars=grammars)


@pytest.fixture(scope="module")
def model_fp32():
    from models import load_model

    return load_model(ZOO, dtype=torch.float32)


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def params(spec: StructuredSpec | None, n: int = 48, **sampling) -> GenerationParams:
    return GenerationParams(max_tokens=n, structured=spec,
                            sampling=SamplingParams(temperature=sampling.pop("temperature", 0.0),
                                                    **sampling))


# ---- the request forms -----------------------------------------------------------------
def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_request_forms_become_one_spec_each():
    assert request().structured_spec() is None
    assert request(response_format={"type": "text"}).structured_spec() is None
    assert request(response_format={"type": "json_object"}).structured_spec() == \
        StructuredSpec("json_object", "", "response_format")
    spec = request(response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": CITY, "strict": True}}).structured_spec()
    assert spec.kind == "json_schema" and json.loads(spec.value) == CITY
    spec = request(structured_outputs={"json": json.dumps(CITY)}).structured_spec()
    assert spec.field == "structured_outputs.json" and json.loads(spec.value) == CITY
    assert request(structured_outputs={"regex": r"\d+"}).structured_spec() == \
        StructuredSpec("regex", r"\d+", "structured_outputs.regex")
    spec = request(structured_outputs={"choice": ["yes", 'say "no"', "yes"]}).structured_spec()
    assert spec.kind == "grammar" and spec.value == 'root ::= "yes" | "say \\"no\\""'


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex"),
])
def test_malformed_forms_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as err:
        request(**fields).structured_spec()
    assert err.value.status == 400 and err.value.param == param


# ---- the mask ----------------------------------------------------------------------------
def test_the_bitmask_leaves_exactly_the_allowed_tokens():
    allowed = {0, 5, 31, 32, 33, 63, 99}
    words = torch.zeros(4, dtype=torch.int32)
    for t in allowed:
        words[t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    assert set(unpack_bitmask(words, 100).nonzero()[:, 0].tolist()) == allowed
    logits = torch.randn(2, 100)
    out, rest = apply_masks(logits, [History([], [], (), words), History([], [], ())])
    assert set(torch.isfinite(out[0]).nonzero()[:, 0].tolist()) == allowed
    assert torch.equal(out[0, sorted(allowed)], logits[0, sorted(allowed)])
    assert torch.equal(out[1], logits[1]) and rest[0].allowed is None     # unmasked row


# ---- the engine ------------------------------------------------------------------------------
def test_constrained_greedy_output_matches_the_schema_and_frees_its_blocks(engine, tok):
    ids = chat_ids(tok, "Describe Paris as JSON.")
    seq = engine.generate([ids], params(StructuredSpec("json_schema", json.dumps(CITY))))[0]
    text = tok.decode(seq.output_ids, skip_special_tokens=True)
    assert seq.finish_reason == "stop"
    jsonschema.validate(json.loads(text), CITY)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_unconstrained_rows_in_the_same_batch_are_unchanged(engine, tok):
    ids = chat_ids(tok, "Name a colour.")
    alone = engine.generate([ids], params(None, 12))[0].output_ids
    free, bound = engine.generate([ids, ids], [params(None, 12),
                                               params(StructuredSpec("regex", "(red|blue)"))])
    assert free.output_ids == alone
    assert tok.decode(bound.output_ids, skip_special_tokens=True) in ("red", "blue")


def test_choice_regex_and_grammar_forms(engine, tok):
    ids = chat_ids(tok, "Is the sky blue? Answer yes or no.")
    choice = request(structured_outputs={"choice": ["yes", "no"]}).structured_spec()
    specs = [choice, StructuredSpec("regex", r"[0-9]{3}-[0-9]{4}"),
             StructuredSpec("grammar", 'root ::= "(" [a-z]+ ")"')]
    seqs = engine.generate([ids] * 3, [params(s, 24) for s in specs])
    texts = [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]
    assert texts[0] in ("yes", "no")
    assert len(texts[1]) == 8 and texts[1][3] == "-" and texts[1].replace("-", "").isdigit()
    assert texts[2].startswith("(") and (seqs[2].finish_reason == "length"
                                         or texts[2].endswith(")"))


def test_seeded_sampling_stays_inside_the_grammar(engine, tok):
    ids = chat_ids(tok, "Describe a city as JSON.")
    for seed in range(3):
        seq = engine.generate([ids], params(StructuredSpec("json_schema", json.dumps(CITY)), 64,
                                            temperature=1.0, seed=seed))[0]
        if seq.finish_reason == "stop":
            jsonschema.validate(json.loads(tok.decode(seq.output_ids,
                                                      skip_special_tokens=True)), CITY)
        else:        # cut by max_tokens: still a prefix the grammar allows
            assert tok.decode(seq.output_ids).startswith("{")


def test_a_migrated_request_resumes_with_its_grammar_state(engine, tok):
    ids = chat_ids(tok, "Describe Paris as JSON.")
    p = params(StructuredSpec("json_schema", json.dumps(CITY)))
    whole = engine.generate([ids], p)[0].output_ids
    seq_id = engine.add_request(ids, p, output_ids=whole[:5])
    while engine.has_unfinished():
        engine.step()
    assert engine.pop(seq_id).output_ids == whole


def test_a_spec_that_does_not_compile_is_a_request_error(engine):
    with pytest.raises(RequestError) as err:
        engine.add_request([1, 2, 3], params(StructuredSpec(
            "json_schema", json.dumps({"$ref": "#/definitions/missing"}), "response_format")))
    assert err.value.field == "response_format" and "cannot be compiled" in str(err.value)
    assert not engine.has_unfinished()


def test_an_engine_without_a_tokenizer_refuses_structured_requests(model_fp32):
    bare = LLMEngine(model_fp32, EngineConfig(kv_cache_bytes=8 << 20))
    with pytest.raises(RequestError, match="tokenizer"):
        bare.add_request([1, 2, 3], params(StructuredSpec("json_object")))


def test_every_benchmark_schema_compiles_or_is_refused_with_a_request_error(engine):
    """The 240 JSONSchemaBench schemas: each compiles or is a RequestError, never another
    exception; most compile."""
    compiled = refused = 0
    for path in sorted(SCHEMAS.glob("*/*.json")):
        text = path.read_text()
        if not text.strip():
            continue                       # an empty file in the corpus
        try:
            engine.grammars.compile(StructuredSpec("json_schema", text))
            compiled += 1
        except RequestError as exc:
            assert "cannot be compiled" in str(exc)
            refused += 1
    assert compiled + refused >= 235
    assert compiled >= 0.9 * (compiled + refused)


# ---- llguidance: the guidance backend, and xgrammar's fallback under auto -----------------
@pytest.fixture(scope="module")
def guided(model_fp32, tok):
    grammars = Grammars(lambda: tok, model_fp32.config.vocab_size, eos_token_ids(ZOO),
                        backend="guidance")
    return LLMEngine(model_fp32, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=8),
                     eos_token_ids=eos_token_ids(ZOO), grammars=grammars)


def test_the_guidance_backend_decodes_every_form(guided, tok):
    ids = chat_ids(tok, "Describe Paris as JSON.")
    choice = request(structured_outputs={"choice": ["yes", "no"]}).structured_spec()
    specs = [StructuredSpec("json_schema", json.dumps(CITY)), choice,
             StructuredSpec("regex", r"[0-9]{3}-[0-9]{4}"),
             StructuredSpec("grammar", 'root ::= "(" [a-z]+ ")"'),
             StructuredSpec("json_object")]
    assert {guided.grammars.compile(s).backend for s in specs} == {"guidance"}
    seqs = guided.generate([ids] * len(specs), [params(s, 40) for s in specs])
    texts = [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]
    assert seqs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(texts[0]), CITY)
    assert texts[1] in ("yes", "no")
    assert len(texts[2]) == 8 and texts[2][3] == "-" and texts[2].replace("-", "").isdigit()
    assert texts[3].startswith("(") and (seqs[3].finish_reason == "length"
                                         or texts[3].endswith(")"))
    assert texts[4].startswith("{")
    assert guided.blocks.num_free == guided.blocks.num_blocks


def test_the_guidance_backend_forces_tool_calls(guided, tok):
    from services.gateway.tools import FORMATS

    functions = [{"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 20}}}}]
    spec = FORMATS["hermes"].grammar(functions, parallel=True)
    ids = chat_ids(tok, "What is the weather in Paris?")
    seq = guided.generate([ids], params(spec, 60))[0]
    text = tok.decode(seq.output_ids, skip_special_tokens=True)
    _, calls = FORMATS["hermes"].parse(text, {"get_weather"})
    assert calls and all(c.name == "get_weather" for c in calls), text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), functions[0]["parameters"])


def test_auto_falls_back_to_guidance_and_a_spec_neither_compiles_names_both(engine, tok):
    lark = 'start: "yes" | "no"'                    # Lark: xgrammar reads only EBNF
    compiled = engine.grammars.compile(StructuredSpec("grammar", lark))
    assert compiled.backend == "guidance"
    assert engine.grammars.compile(StructuredSpec("regex", "(red|blue)")).backend == "xgrammar"
    # rows of both backends in one batch: one bitmask, each row filled by its own
    ids = chat_ids(tok, "Is the sky blue? Answer yes or no.")
    seqs = engine.generate([ids, ids], [params(StructuredSpec("grammar", lark), 8),
                                        params(StructuredSpec("regex", "(red|blue)"), 8)])
    texts = [tok.decode(s.output_ids, skip_special_tokens=True) for s in seqs]
    assert texts[0] in ("yes", "no") and texts[1] in ("red", "blue")
    with pytest.raises(RequestError) as err:
        engine.grammars.compile(StructuredSpec("regex", "(unclosed", "structured_outputs.regex"))
    message = str(err.value)
    assert err.value.field == "structured_outputs.regex"
    assert "xgrammar: " in message and "guidance: " in message


def test_a_schema_xgrammar_would_leave_unenforced_is_not_served_as_any_json(engine):
    """xgrammar reads a schema with allOf of if/then as any JSON value, with a warning only.
    Such a schema is not served unenforced: `auto` tries llguidance, and when it cannot
    either, the 400 names both reasons (llguidance names the keys)."""
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"kind": {"enum": ["a", "b"]}, "size": {"type": "integer"}},
              "allOf": [{"if": {"properties": {"kind": {"const": "a"}}},
                         "then": {"required": ["size"]}}]}
    import xgrammar as xgr

    loose = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert xgr.GrammarMatcher(engine.grammars.compiler.compile_grammar(loose)).accept_string(
        "null")                                 # what it would have enforced: any JSON
    with pytest.raises(RequestError) as err:
        engine.grammars.compile(StructuredSpec("json_schema", json.dumps(schema)))
    message = str(err.value)
    assert "xgrammar reads this schema as any JSON value" in message
    assert "guidance: " in message and '"if"' in message
    # the same schema without the if/then is enforced by xgrammar, null refused
    del schema["allOf"]
    compiled = engine.grammars.compile(StructuredSpec("json_schema", json.dumps(schema)))
    assert compiled.backend == "xgrammar"
    assert not xgr.GrammarMatcher(compiled.grammar).accept_string("null")
