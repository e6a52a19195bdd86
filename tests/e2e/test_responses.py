"""/v1/responses with the official `openai` client, on the embedded and the Ray deployment:
text, `previous_response_id` (stored in this process, and in a real Redis with its TTL), retrieval, a function-tool loop, and the
streamed events against the whole response."""
from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
import redis

from services.deployment.server import build_embedded
from services.gateway.protocol import APIError
from services.gateway.responses import ResponseStore, history
from tests.helpers.gateway import MODEL, ZOO, client, ray_deployment, running

pytestmark = pytest.mark.slow

REDIS = "redis://127.0.0.1:6379/0"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "additionalProperties": False,
                         "required": ["city"],
                         "properties": {"city": {"type": "string", "maxLength": 30}}}}]
GREEDY = {"max_output_tokens": 20, "temperature": 0}


@pytest.fixture(scope="module", params=["memory", "redis", "ray"])
def base(request):
    """The embedded deployment with each store, and the Ray deployment with Redis's."""
    store = ResponseStore(None if request.param == "memory" else REDIS, ttl_s=120)
    if request.param == "ray":
        request.getfixturevalue("ray_session")
        with ray_deployment(responses=store) as url:
            yield url, "redis"
        return
    app = build_embedded(ZOO, kv_cache_bytes=64 << 20, threads=1, responses=store)
    with running(app) as url:
        yield url, request.param


def test_text_previous_response_and_retrieval(base):
    url, where = base
    c = client(url)
    first = c.responses.create(model=MODEL, input="What is the capital of France?", **GREEDY)
    assert first.status == "completed" and "Paris" in first.output_text
    assert first.usage.input_tokens > 0 and 0 < first.usage.output_tokens <= 20
    follow = c.responses.create(model=MODEL, input="And of Italy?",
                                previous_response_id=first.id, **GREEDY)
    assert follow.previous_response_id == first.id and "Rome" in follow.output_text
    assert c.responses.retrieve(first.id).output_text == first.output_text
    if where == "redis":
        ttl = redis.Redis.from_url(REDIS).ttl(f"splitstack:response:{first.id}")
        assert 0 < ttl <= 120


def test_store_false_and_unknown_ids_are_404s(base):
    c = client(base[0])
    r = c.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    for rid in (r.id, "resp_" + uuid.uuid4().hex):
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model=MODEL, input="Hi", previous_response_id=rid,
                               max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(rid)


def test_a_function_tool_loop(base):
    c = client(base[0])
    r = c.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                           tool_choice="required", parallel_tool_calls=False,
                           max_output_tokens=60, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments.startswith('{"city": ')
    done = c.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS,
                              input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "18 C, clear"}], **GREEDY)
    assert done.status in ("completed", "incomplete") and done.output_text


def test_streamed_events_rebuild_the_whole_response(base):
    c = client(base[0])
    whole = c.responses.create(model=MODEL, input="What is the capital of France?", **GREEDY)
    with c.responses.stream(model=MODEL, input="What is the capital of France?",
                            **GREEDY) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    call = c.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                              tool_choice="required", parallel_tool_calls=False,
                              max_output_tokens=60, temperature=0).output[0]
    with c.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                            tool_choice="required", parallel_tool_calls=False,
                            max_output_tokens=60, temperature=0) as s:
        args = "".join(e.delta for e in s
                       if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    assert args == call.arguments and [o.type for o in final.output] == ["function_call"]


@pytest.mark.parametrize("items", [
    [{"type": "image", "url": "x"}],
    [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
    [{"type": "function_call", "call_id": "c", "name": "f"}],
    [{"role": "robot", "content": "hi"}],
])
def test_input_items_that_are_not_served_are_400s(items):
    with pytest.raises(APIError) as err:
        history(items)
    assert err.value.status == 400 and err.value.param == "input"


def test_a_bad_request_is_a_400_over_http(base):
    with pytest.raises(openai.BadRequestError) as err:
        client(base[0]).responses.create(model=MODEL, input=[{"type": "image"}],
                                         max_output_tokens=4)
    assert err.value.body["param"] == "input"


def test_the_memory_store_expires_entries():
    store = ResponseStore(ttl_s=0)

    async def run():
        await store.put("r", {"messages": [], "response": {}})
        await asyncio.sleep(0.01)
        return await store.get("r")

    assert asyncio.run(run()) is None


# ---- reasoning items (a played-back thinking answer; SmolLM2 does not think) ---------------
THOUGHT, ANSWER = "The capital of France is Paris, which I know well.", "Paris."


@pytest.fixture(scope="module")
def thinking_base():
    from services.common.tokenizer import load_tokenizer
    from services.gateway.app import build_app
    from services.gateway.gateway import Gateway
    from tests.helpers.playback import PlaybackEngine

    tokenizer = load_tokenizer(ZOO)
    tokens = tokenizer(f"<think>{THOUGHT}</think>{ANSWER}", add_special_tokens=False)["input_ids"]
    gateway = Gateway(PlaybackEngine(tokens, reason="stop"), tokenizer, MODEL, 4096,
                      reasoning_parser="qwen3")
    with running(build_app(gateway)) as url:
        yield url, tokenizer


def test_thinking_is_a_reasoning_item_whole_and_streamed(thinking_base):
    url, tokenizer = thinking_base
    c = client(url)
    whole = c.responses.create(model=MODEL, input="Where is Paris?", max_output_tokens=200)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    (part,) = whole.output[0].content
    assert part.type == "reasoning_text" and part.text.strip() == THOUGHT
    assert whole.output_text.strip() == ANSWER and ANSWER not in part.text
    thought_tokens = len(tokenizer(part.text, add_special_tokens=False)["input_ids"])
    assert whole.usage.output_tokens_details.reasoning_tokens == thought_tokens > 0
    events = list(c.responses.create(model=MODEL, input="Where is Paris?",
                                     max_output_tokens=200, stream=True))
    kinds = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == part.text and len([k for k in kinds
                                        if k == "response.reasoning_text.delta"]) > 1
    # the reasoning item closes before the message opens
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == part.text
    assert final.output_text == whole.output_text
    # a client that sends its earlier output back: the reasoning item is accepted, not sent
    again = c.responses.create(model=MODEL, max_output_tokens=200, input=[
        {"role": "user", "content": "Where is Paris?"},
        *[o.model_dump(exclude_none=True) for o in whole.output],
        {"role": "user", "content": "And Rome?"}])
    assert again.status == "completed"
