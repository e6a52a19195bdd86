"""The exact engine against the full forward, and its bookkeeping under every ending."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import History, SamplingParams, process_logits
from models import load_model
from services.common.messages import PrefillRequest
from services.engine import EngineConfig, GenerationParams, LLMEngine, RequestError
from services.prefill.service import PrefillService
from tests.helpers.checkpoints import FAMILIES

GREEDY_31 = GenerationParams(max_tokens=31, ignore_eos=True, return_logits=True)


def full_forward_logits(model, seq):
    """Logits the full forward assigns to each sampled position of `seq`."""
    full = model.forward(torch.tensor([seq.tokens[:-1]]))[0]
    return full[len(seq.prompt_ids) - 1:]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lengths", [(100,), (37, 100, 5)])
def test_prefill_plus_30_decode_steps_match_full_forward(family, lengths, tiny_checkpoint):
    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    # chunk 40 < 100: the long prompt is prefilled in 3 chunks while the others decode
    engine = LLMEngine(model, EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=40,
                                           max_num_batched_tokens=64))
    gen = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in lengths]
    seqs = engine.generate(prompts, GREEDY_31)
    for seq in seqs:
        assert len(seq.output_ids) == 31 and seq.finish_reason == "length"
        got = torch.stack(seq.logits)
        ref = full_forward_logits(model, seq)
        assert (got - ref).abs().max().item() <= 1e-4
        assert seq.output_ids == got.argmax(-1).tolist()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check()


@pytest.fixture
def engine_qwen35(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5")
    return LLMEngine(load_model(path), EngineConfig(block_size=4, num_blocks=24, max_num_seqs=4,
                                                    max_prefill_chunk=16,
                                                    max_num_batched_tokens=32))


def test_blocks_are_taken_in_order_and_all_return(engine_qwen35):
    eng = engine_qwen35
    a = eng.add_request(list(range(1, 10)), GenerationParams(max_tokens=3, ignore_eos=True))
    b = eng.add_request(list(range(1, 6)), GenerationParams(max_tokens=3, ignore_eos=True))
    eng.step()                                        # both prompts prefilled in one step
    assert eng.seqs[a].block_table == [0, 1, 2] and eng.seqs[b].block_table == [3, 4]
    assert eng.seqs[a].state_slot == 0 and eng.seqs[b].state_slot == 1
    while eng.has_unfinished():
        eng.step()
    assert eng.seqs[a].finish_reason == "length"
    assert sorted(eng.blocks.free_queue) == list(range(24)) and eng.slots.num_free == 4
    eng.blocks.check()


def test_finished_cancelled_and_failed_all_free_their_blocks(engine_qwen35, monkeypatch):
    eng = engine_qwen35
    p = GenerationParams(max_tokens=6, ignore_eos=True)
    done = eng.add_request([5, 6, 7], GenerationParams(max_tokens=1, ignore_eos=True))
    cancelled = eng.add_request(list(range(20, 31)), p)
    doomed = eng.add_request(list(range(40, 45)), p)
    survivor = eng.add_request([9, 9, 9, 9], p)
    eng.step()
    assert eng.seqs[done].finish_reason == "length"
    assert eng.seqs[cancelled].block_table == [1, 2, 3]
    assert eng.abort(cancelled)
    assert eng.seqs[cancelled].block_table == [] and eng.seqs[cancelled].finish_reason == "abort"
    real_run = eng.runner.run

    def failing_run(out):                 # the step that holds `doomed` fails
        if any(c.seq.seq_id == doomed for c in out.chunks):
            raise RuntimeError("injected device fault")
        return real_run(out)

    monkeypatch.setattr(eng.runner, "run", failing_run)
    outs = eng.step()
    assert {o.seq_id for o in outs if o.error} == {doomed, survivor}
    assert eng.seqs[doomed].error == "RuntimeError: injected device fault"
    # every block and state slot is back, in a known order
    assert eng.blocks.num_free == 24 and eng.slots.num_free == 4
    # `done` [0] and `cancelled` [1, 2, 3] went back to the front of the queue, so
    # `survivor`'s decode took block 1; then `doomed` [4, 5] and `survivor` [6, 1] went back,
    # each to the front; 7..23 were never used
    assert list(eng.blocks.free_queue) == [6, 1, 4, 5, 2, 3, 0] + list(range(7, 24))
    eng.blocks.check()
    monkeypatch.setattr(eng.runner, "run", real_run)
    seqs = eng.generate([[1, 2, 3]], GenerationParams(max_tokens=2, ignore_eos=True))
    assert len(seqs[0].output_ids) == 2                # the engine keeps serving


def test_preemption_recomputes_and_matches_unpreempted(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_next")
    model = load_model(path)
    prompts = [list(range(1, 15)), list(range(100, 113)), list(range(200, 210))]
    p = GenerationParams(max_tokens=12, ignore_eos=True)
    roomy = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    tight = LLMEngine(model, EngineConfig(block_size=4, num_blocks=14, max_num_seqs=3))
    ref = [s.output_ids for s in roomy.generate(prompts, p)]
    preempted = []
    orig = tight.scheduler.schedule

    def spy():
        out = orig()
        preempted.extend(out.preempted)
        return out

    tight.scheduler.schedule = spy
    got = [s.output_ids for s in tight.generate(prompts, p)]
    assert preempted, "the tight cache should have forced a preemption"
    assert got == ref
    assert tight.blocks.num_free == 14 and tight.slots.num_free == 3


def test_min_tokens_holds_back_eos_and_stop_tokens(tiny_checkpoint):
    """Before min_tokens the end-of-sequence and stop tokens cannot be sampled (the run
    that would have stopped at once goes on); after it they stop the request again."""
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    free = LLMEngine(model).generate([[3, 4, 5]], GenerationParams(
        max_tokens=8, ignore_eos=True, return_logits=True))[0]
    eos, stop = free.output_ids[0], free.output_ids[1]
    seq = LLMEngine(model, eos_token_ids=(eos,)).generate([[3, 4, 5]], GenerationParams(
        max_tokens=8, min_tokens=4, stop_token_ids=(stop,), return_logits=True))[0]
    assert len(seq.output_ids) >= 4 and not {eos, stop} & set(seq.output_ids[:4])
    assert seq.output_ids[0] == free.logits[0].clone().index_fill_(0, torch.tensor(
        [eos, stop]), float("-inf")).argmax().item()
    tail = seq.output_ids[4:]
    assert seq.finish_reason == ("stop" if tail and tail[-1] in (eos, stop) else "length")
    with pytest.raises(RequestError, match="min_tokens"):
        GenerationParams(max_tokens=2, min_tokens=3)


def test_eos_and_stop_tokens_finish_with_stop(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    free_run = LLMEngine(model).generate([[3, 4, 5]], GenerationParams(max_tokens=5,
                                                                        ignore_eos=True))[0]
    first = free_run.output_ids[0]
    eng = LLMEngine(model, eos_token_ids=(first,))
    seq = eng.generate([[3, 4, 5]], GenerationParams(max_tokens=5))[0]
    assert seq.output_ids == [first] and seq.finish_reason == "stop"
    third = free_run.output_ids[2]
    seq = LLMEngine(model).generate([[3, 4, 5]], GenerationParams(
        max_tokens=5, stop_token_ids=(third,), ignore_eos=True))[0]
    assert seq.output_ids == free_run.output_ids[:3] and seq.finish_reason == "stop"


@pytest.mark.parametrize("prompt,params,field", [
    ([], GenerationParams(), "prompt"),
    ([1, 5000], GenerationParams(), "prompt"),
    ([1, 2], GenerationParams(max_tokens=5000), "max_tokens"),
])
def test_bad_requests_are_refused_without_side_effects(prompt, params, field, engine_qwen35):
    with pytest.raises(RequestError) as err:
        engine_qwen35.add_request(prompt, params)
    assert err.value.field == field
    assert not engine_qwen35.has_unfinished() and engine_qwen35.blocks.num_free == 24


def test_max_tokens_must_be_positive():
    with pytest.raises(RequestError, match="max_tokens"):
        GenerationParams(max_tokens=0)


@pytest.mark.parametrize("k", [-1, 21, 2.0, True])
def test_logprobs_must_be_a_small_count(k):
    with pytest.raises(RequestError, match="logprobs"):
        GenerationParams(logprobs=k)


def test_steps_report_the_asked_alternatives_of_the_models_distribution(tiny_checkpoint):
    """`logprobs=k`: every step's output holds the k most likely tokens of the logits the
    token was sampled from, with their log-probs; requests that do not ask get None."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    eng = LLMEngine(model)
    sampled = GenerationParams(max_tokens=6, ignore_eos=True, return_logits=True, logprobs=3,
                               sampling=SamplingParams(temperature=1.0, seed=3))
    asked = eng.add_request([5, 6, 7, 8], sampled)
    plain = eng.add_request([9, 10], GenerationParams(max_tokens=6, ignore_eos=True))
    outs = {asked: [], plain: []}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.seq_id].append(out)
    assert all(o.top_logprobs is None for o in outs[plain])
    seq = eng.seqs[asked]
    assert [o.token for o in outs[asked]] == seq.output_ids
    for out, logits in zip(outs[asked], seq.logits):
        ref = torch.log_softmax(logits.float(), -1)
        assert [t for t, _ in out.top_logprobs] == ref.topk(3).indices.tolist()
        assert all(abs(lp - ref[t].item()) < 1e-5 for t, lp in out.top_logprobs)
        assert abs(out.logprob - ref[out.token].item()) < 1e-5


def test_seeded_sampling_is_batch_independent(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    p = GenerationParams(max_tokens=8, ignore_eos=True,
                         sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=11))
    alone = LLMEngine(model).generate([[1, 2, 3]], p)[0].output_ids
    batched = LLMEngine(model).generate([[7, 8], [1, 2, 3], [4] * 9], p)[1].output_ids
    assert alone == batched


def test_stalled_prefills_make_progress(tiny_checkpoint):
    """Two long prompts admitted together fill the cache mid-prefill; one must yield."""
    path, _ = tiny_checkpoint("qwen3")
    model = load_model(path)
    eng = LLMEngine(model, EngineConfig(block_size=4, num_blocks=12, max_prefill_chunk=8,
                                        max_num_batched_tokens=16))
    prompts = [list(range(1, 41)), list(range(50, 90))]
    p = GenerationParams(max_tokens=4, ignore_eos=True)
    preempted = []
    orig = eng.scheduler._schedule_once

    def spy():
        out = orig()
        if out.empty:
            preempted.append(len(eng.scheduler.running))
        return out

    eng.scheduler._schedule_once = spy
    got = [s.output_ids for s in eng.generate(prompts, p)]
    ref = [s.output_ids for s in LLMEngine(model).generate(prompts, p)]
    assert preempted == [2], "both prefills should have stalled once"
    assert got == ref and eng.blocks.num_free == 12


def test_context_is_capped_to_what_the_cache_holds(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")
    eng = LLMEngine(load_model(path), EngineConfig(block_size=16, num_blocks=10))
    assert eng.max_model_len == 160
    with pytest.raises(RequestError, match="context length 160"):
        eng.add_request([1] * 100, GenerationParams(max_tokens=61))
    eng.add_request([1] * 100, GenerationParams(max_tokens=60))


def test_export_prompt_hands_back_kv_states_and_logits(tiny_checkpoint):
    """`export_prompt` (the prefill service's engine): a prompt prefilled in several chunks
    comes back as one monolithic forward's KV, its GDN states, and its last-row logits."""
    from services.prefix_cache.replay import continue_prefill, prompt_rows, zero_states

    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    ids = torch.randint(0, 1024, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    engine = LLMEngine(model, EngineConfig(max_prefill_chunk=16, max_num_batched_tokens=16))
    params = GenerationParams(max_tokens=1, export_prompt=True, ignore_eos=True)
    outs = []
    engine.add_request(ids, params)
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].export is not None
    ex = outs[0].export
    kv, _ = prompt_rows(model, torch.tensor(ids))
    logits, _, states = continue_prefill(model, torch.tensor(ids), kv[:, :, :0],
                                         zero_states(model), return_cache=True)
    # chunks of 16 vs one pass round differently in the GDN layers (up to 1.3e-5 in K/V and
    # conv states on an AMD EPYC with MKL; under 1e-5 on the Intel machines before it)
    assert ex.num_tokens == 37 and (ex.kv - kv).abs().max() <= 5e-5
    assert (ex.recurrent - states.recurrent).abs().max() <= 1e-4
    assert (ex.conv - states.conv).abs().max() <= 5e-5
    assert (ex.logits - logits[-1]).abs().max() <= 1e-4
    assert engine.blocks.num_free == engine.blocks.num_blocks


PENALIZED = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3,
                           logit_bias=((7, 4.0), (9, -100.0)))


def test_penalties_and_bias_choose_from_the_processed_logits(tiny_checkpoint):
    """Each greedy token is the argmax of the step's logits after bias and penalties over
    the request's tokens so far; the run differs from the plain one."""
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    prompt = [3, 4, 5, 7, 7]
    params = GenerationParams(max_tokens=10, ignore_eos=True, return_logits=True,
                              sampling=PENALIZED)
    seq = LLMEngine(model).generate([prompt], params)[0]
    for i, logits in enumerate(seq.logits):
        row = process_logits(logits.float(), PENALIZED, History(prompt, seq.output_ids[:i]))
        assert seq.output_ids[i] == row.argmax().item()
    assert 9 not in seq.output_ids
    plain = LLMEngine(model).generate([prompt], GenerationParams(max_tokens=10,
                                                                 ignore_eos=True))[0]
    assert plain.output_ids != seq.output_ids


def test_logit_bias_outside_the_vocabulary_is_refused(engine_qwen35):
    vocab = engine_qwen35.model.config.vocab_size
    with pytest.raises(RequestError) as err:
        engine_qwen35.add_request([1, 2], GenerationParams(
            sampling=SamplingParams(logit_bias=((vocab, 1.0),))))
    assert err.value.field == "logit_bias" and not engine_qwen35.has_unfinished()


def test_prompt_logprobs_over_chunks_and_preemption_match_the_full_forward(tiny_checkpoint):
    """Each prompt token after the first gets its log-prob under the full forward, with
    the k most likely alternatives; a prompt prefilled in chunks, and one preempted and
    recomputed, score every row once."""
    path, _ = tiny_checkpoint("qwen3_5")
    model = load_model(path)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 1024, (45,), generator=gen).tolist()
    ref = torch.log_softmax(model.forward(torch.tensor([prompt]))[0].float(), -1)
    params = GenerationParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    for cfg in (EngineConfig(max_prefill_chunk=16, max_num_batched_tokens=32),
                EngineConfig(block_size=4, num_blocks=14, max_num_seqs=2,
                             max_prefill_chunk=16, max_num_batched_tokens=32)):
        eng = LLMEngine(model, cfg)
        crowd = eng.add_request(prompt[:20], GenerationParams(max_tokens=20, ignore_eos=True))
        ids = [eng.add_request(prompt, params), crowd]     # the newer one is preempted
        schedule, preempted = eng.scheduler.schedule, []

        def counting():
            out = schedule()
            preempted.extend(s.seq_id for s in out.preempted)
            return out

        eng.scheduler.schedule = counting
        firsts = {}
        while eng.has_unfinished():
            for out in eng.step():
                firsts.setdefault(out.seq_id, out)
        assert (ids[0] in preempted) == (cfg.num_blocks is not None)
        entries = firsts[ids[0]].prompt_logprobs
        assert [e.token for e in entries] == prompt[1:]
        got = torch.tensor([e.logprob for e in entries])
        want = ref[torch.arange(44), torch.tensor(prompt[1:])]
        assert (got - want).abs().max().item() < 1e-4
        assert all([t for t, _ in e.top] == ref[j].topk(2).indices.tolist()
                   for j, e in enumerate(entries))
        assert firsts[ids[1]].prompt_logprobs is None
        assert eng.blocks.num_free == eng.blocks.num_blocks


def test_prompt_logprobs_need_the_exact_prefill(tiny_checkpoint):
    """The engine resolves a request's prefill fields; one that RidgeFill prefills cannot
    give the prompt's log-probs."""
    path, _ = tiny_checkpoint("llama3")
    model = load_model(path)
    engine = LLMEngine(model, EngineConfig(num_blocks=32), prefill_service=PrefillService(model))
    filled = PrefillRequest("ridgefill", {"fill": "identity", "split": 1, "tail": 4})
    with pytest.raises(RequestError, match="exact prefill"):
        engine.add_request(list(range(1, 40)), GenerationParams(prompt_logprobs=1,
                                                                prefill=filled))
    engine.add_request(list(range(1, 40)), GenerationParams(
        prompt_logprobs=1, prefill=PrefillRequest("exact")))
