"""Speculative decoding by n-gram prompt lookup: the proposer finds the latest earlier match
of the longest suffix; a greedy engine that drafts gives exactly the tokens (and, within
rounding, the logits) of one that does not, with penalties and `min_tokens` too; drafts
respect `max_tokens`; rejected drafts give their blocks back, and on the Gated DeltaNet
hybrids their recurrent states roll back; both deployments draft."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import SamplingParams
from models import load_model
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.engine.speculative import NgramConfig, propose
from tests.helpers.tail_replay import prompt

# every draft verified whole (the planner, which trims drafts by measured cost, is off)
SPEC = NgramConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                   adaptive=False)


def test_propose_takes_what_followed_the_latest_longest_match():
    cfg = NgramConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    assert propose(tokens, cfg, limit=10) == [3, 4, 6]      # "6 7" last seen at 6..7
    assert propose(tokens, cfg, limit=2) == [3, 4]
    assert propose(tokens, cfg, limit=0) == []
    # the 3-gram "9 6 7" beats the later 2-gram match
    assert propose([9, 6, 7, 8, 0, 6, 7, 1, 9, 6, 7], cfg, limit=10) == [8, 0, 6]
    assert propose([1, 2, 3, 4, 5], cfg, limit=10) == []    # no earlier match
    assert propose([1, 2], cfg, limit=10) == []
    # a match whose continuation runs to the end drafts what there is
    assert propose([4, 4, 4], NgramConfig(4, 1, 1), limit=10) == [4]


def test_config_takes_vllms_form_and_refuses_what_it_cannot_run():
    cfg = NgramConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert cfg == NgramConfig(5, 4, 2)
    with pytest.raises(ValueError, match="'eagle'"):
        NgramConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown speculative-config keys"):
        NgramConfig.from_dict({"num_speculative_tokens": 2, "model": "x"})
    with pytest.raises(ValueError, match="integers"):
        NgramConfig.from_dict({"num_speculative_tokens": 2.5})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramConfig(2, 1, 3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramConfig(0)
    assert NgramConfig.from_dict({"adaptive": False}).adaptive is False
    assert NgramConfig().adaptive is True
    with pytest.raises(ValueError, match="adaptive"):
        NgramConfig.from_dict({"adaptive": 1})


def drafted(*drafts, rates=None):
    from services.engine.sequence import Sequence

    seqs = [Sequence(i, [1, 2, 3], GenerationParams()) for i in range(len(drafts))]
    for s, d, r in zip(seqs, drafts, rates or [None] * len(drafts)):
        s.draft, s.draft_rate = list(d), r
    return seqs


def test_planner_fits_the_step_cost_and_keeps_the_draft_tokens_that_pay():
    """The planner times steps by rows (a + b·rows) and keeps draft token i of a request
    while rate^i tokens for b seconds beat the step's tokens per second so far."""
    from services.engine.speculative import DraftPlanner

    planner = DraftPlanner()
    seqs = drafted([5, 6, 7, 8])
    planner.trim(seqs, rows=1)                      # no cost known yet: the whole draft
    assert seqs[0].draft == [5, 6, 7, 8] and planner.cost() is None
    for rows, seconds in ((1, 0.018), (5, 0.022), (9, 0.026)):
        planner.observe_step(rows, seconds)
    a, b = planner.cost()
    assert a == pytest.approx(0.017) and b == pytest.approx(0.001)
    # a step of one row: 18 ms for a token, 1 ms per draft token. The 0.9-rate draft pays
    # whole (0.66 tokens for 1 ms at its 4th), and the 0.3-rate draft's first token (0.3
    # for 1 ms); its second (0.09 for 1 ms, 90 a second) is below the step's ~190 a second
    seqs = drafted([5, 6, 7, 8], [5, 6], rates=[0.9, 0.3])
    planner.trim(seqs, rows=1)
    assert [s.draft for s in seqs] == [[5, 6, 7, 8], [5]]
    # eight rows in 100 ms, 10 ms per row (80 tokens a second): a draft token must be
    # kept with probability above 0.8 or so
    expensive = DraftPlanner()
    for rows, seconds in ((8, 0.10), (16, 0.18)):
        expensive.observe_step(rows, seconds)
    seqs = drafted([5, 6, 7, 8], [5, 6, 7, 8], rates=[0.95, 0.3])
    expensive.trim(seqs, rows=8)
    assert seqs[1].draft == []                     # chat-like: nothing pays
    assert seqs[0].draft == [5, 6, 7]              # copy-like: 0.95, 0.90, 0.86 (not 0.81)
    # rows cost the same whether draft or not, nothing fixed per step: no draft pays
    flat = DraftPlanner()
    for rows, seconds in ((8, 0.16), (16, 0.32)):
        flat.observe_step(rows, seconds)
    seqs = drafted([5, 6], rates=[0.95])
    flat.trim(seqs, rows=8)
    assert seqs[0].draft == []
    # a request with no rate of its own yet verifies one token, whatever it costs
    seqs = drafted([5, 6, 7], rates=[None])
    flat.trim(seqs, rows=8)
    assert seqs[0].draft == [5]
    # acceptance: kept over tries, the first rejected token a try; a request starts from
    # the engine's rate over every draft (1 of 2 before any)
    s = drafted([1])[0]
    planner = DraftPlanner()
    planner.observe_draft(s, proposed=4, accepted=1)        # 1 of 2 tries
    assert s.draft_rate == pytest.approx(0.5)
    planner.observe_draft(s, proposed=4, accepted=4)        # 4 of 4
    assert s.draft_rate == pytest.approx(0.5 + 0.25 * 0.5)
    assert planner.rate == pytest.approx((1 + 1 + 4) / (2 + 2 + 4))


def engines(path, speculative=SPEC, **over):
    model = load_model(path)
    base = dict(block_size=4, num_blocks=256, max_num_seqs=4, **over)
    return (LLMEngine(model, EngineConfig(**base, speculative=speculative)),
            LLMEngine(model, EngineConfig(**base)))


def repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats a phrase: n-gram drafts find matches in it."""
    phrase = prompt(7, seed=seed)
    return (phrase * (n // 7 + 1))[:n]


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_greedy_output_is_the_plain_engines(family, tiny_checkpoint):
    """Same greedy tokens and logits within fp32 rounding, drafts accepted and rejected,
    every block back at the end and none held past a sequence's end between steps."""
    path, _ = tiny_checkpoint(family)
    spec, plain = engines(path)
    params = GenerationParams(max_tokens=24, ignore_eos=True, return_logits=True)
    prompts = [repetitive(40, 1), prompt(30, seed=2), repetitive(23, 3)]
    ids = [spec.add_request(p, params) for p in prompts]
    while spec.has_unfinished():
        spec.step()
        for seq in spec.scheduler.running:     # rejected drafts' blocks went back
            assert len(seq.block_table) <= spec.blocks.blocks_for(seq.num_tokens + 1)
    got = [spec.pop(i) for i in ids]
    ref = plain.generate(prompts, params)
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids
        assert len(g.logits) == len(r.logits) == params.max_tokens
        assert (torch.stack(g.logits) - torch.stack(r.logits)).abs().max().item() <= 1e-4
    stats = spec.spec_stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    assert spec.blocks.num_free == spec.blocks.num_blocks


def test_penalties_min_tokens_and_stops_follow_the_draft(tiny_checkpoint):
    """Row i of a speculative step reads the history after the draft's first i tokens:
    the repetition and frequency penalties and `min_tokens` give the plain engine's
    tokens, and a stop token inside an accepted draft ends the request there."""
    path, _ = tiny_checkpoint("llama3")
    spec, plain = engines(path)
    penalized = GenerationParams(max_tokens=20, min_tokens=12, sampling=SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.4))
    free = GenerationParams(max_tokens=20, ignore_eos=True)
    p = repetitive(35, 4)
    ref_free = plain.generate([p], free)[0].output_ids
    stopping = GenerationParams(max_tokens=20, stop_token_ids=(ref_free[9],), ignore_eos=True)
    got = spec.generate([p, p, p], [penalized, free, stopping])
    ref = plain.generate([p, p, p], [penalized, free, stopping])
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    assert got[2].output_ids[-1] == ref_free[9] and got[2].finish_reason == "stop"
    assert spec.spec_stats.accepted_tokens > 0
    assert spec.blocks.num_free == spec.blocks.num_blocks


def test_drafts_stop_at_max_tokens_and_seeded_sampled_requests_keep_their_tokens(
        tiny_checkpoint):
    """No step emits past `max_tokens`. Sampled requests draft too, verified by rejection
    sampling: with a seed, each row draws with the state a plain decode would have at that
    token, so seeded answers (with top-p, top-k and penalties, over several seeds) are the
    plain engine's token for token, drafts accepted and rejected on the way."""
    path, _ = tiny_checkpoint("llama3")
    spec, plain = engines(path)
    p = repetitive(30, 5)
    sampled = [GenerationParams(max_tokens=24, ignore_eos=True, sampling=SamplingParams(
        temperature=t, seed=seed, top_p=0.95, top_k=200, repetition_penalty=1.05))
        for seed, t in ((7, 0.1), (8, 0.2), (9, 0.4), (10, 0.8))]
    greedy = GenerationParams(max_tokens=9, ignore_eos=True)
    asks = [p, p, repetitive(26, 6), repetitive(33, 7), p]
    params = sampled + [greedy]
    got = spec.generate(asks, params)
    ref = plain.generate(asks, params)
    assert [len(g.output_ids) for g in got] == [24] * 4 + [9]
    assert [g.output_ids for g in got] == [r.output_ids for r in ref]
    stats = spec.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    # the sampled requests alone draft and verify too
    spec.spec_stats.drafts = spec.spec_stats.accepted_tokens = 0
    assert [g.output_ids for g in spec.generate(asks[:4], sampled)] == \
        [r.output_ids for r in ref[:4]]
    assert spec.spec_stats.drafts > 0 and spec.spec_stats.accepted_tokens > 0
    assert spec.blocks.num_free == spec.blocks.num_blocks


def test_the_sampler_gives_the_rejection_rule_its_probabilities():
    """The premise of verifying an unseeded sampled draft by the row's own draw (the
    engine's rule itself is checked token for token by the seeded tests): the sampler's
    draw equals draft token d with probability p(d), and the emitted tokens, kept draft or
    the row's other draw, follow p."""
    from kernels.sampling import draw

    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    draft, n = 1, 20000
    counts = torch.zeros(4)
    kept = 0
    for _ in range(n):
        tok = int(draw(p))                 # the row's draw; kept iff it equals the draft
        kept += tok == draft
        counts[tok] += 1
    assert abs(kept / n - p[draft].item()) < 0.01
    assert (counts / n - p).abs().max().item() < 0.01


def test_no_drafts_past_disable_by_batch_size(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama3")
    params = GenerationParams(max_tokens=12, ignore_eos=True)
    p = repetitive(30, 6)
    one = NgramConfig(4, 3, 1, disable_by_batch_size=1, adaptive=False)
    spec, plain = engines(path, speculative=one)
    got = spec.generate([p, p], params)                   # two running: no drafts
    assert spec.spec_stats.drafts == 0
    assert [g.output_ids for g in got] == [r.output_ids for r in plain.generate([p, p], params)]
    spec.generate([p], params)                            # one: drafts
    assert spec.spec_stats.drafts > 0
    assert NgramConfig.from_dict({"disable_by_batch_size": 4}).disable_by_batch_size == 4
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        NgramConfig(disable_by_batch_size=0)


@pytest.mark.parametrize("family,wiring", [("llama3", "standard"), ("qwen3", "standard"),
                                           ("qwen3", "qfirst")])
def test_qfirst_attention_service_drafts_and_gives_the_exact_tokens(family, wiring,
                                                                    tiny_checkpoint, tmp_path):
    """An attention service's engine drafts too: a draft step's 1 + k rows go through the
    pool's stages and the service's shards like a prompt chunk's, every row is sampled by
    the pool, and the greedy tokens (and logits) are the plain exact engine's, on two KV
    shards and two pool replicas, under either wiring; no block is left behind."""
    from services.attention.runner import qfirst_engine
    from services.deployment.transports import make_transport
    from services.mlp_pool import MLPPool
    from tests.helpers.checkpoints import qfirst_copy

    path, _ = tiny_checkpoint(family)
    if wiring == "qfirst":
        path = qfirst_copy(path, tmp_path / "qfirst")
    model = load_model(path)
    pools = [MLPPool(model, f"pool-{i}") for i in range(2)]
    service = qfirst_engine(model, make_transport("local", pools), num_shards=2,
                            block_size=2, num_blocks=256, max_num_seqs=4, wiring=wiring,
                            speculative=SPEC)
    greedy = GenerationParams(max_tokens=24, ignore_eos=True, return_logits=True)
    seeded = GenerationParams(max_tokens=24, ignore_eos=True, return_logits=True,
                              sampling=SamplingParams(temperature=0.2, seed=5))
    prompts = [repetitive(40, 1), prompt(30, seed=2), repetitive(23, 3), repetitive(30, 4)]
    params = [greedy] * 3 + [seeded]
    got = service.generate(prompts, params)
    ref = LLMEngine(model, EngineConfig(block_size=4, num_blocks=256)).generate(prompts, params)
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids
        assert (torch.stack(g.logits) - torch.stack(r.logits)).abs().max().item() <= 1e-4
    stats = service.spec_stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    service.blocks.check()
    assert service.blocks.num_free == service.blocks.num_blocks


def oracle(prompts, outputs, vocab):
    """A proposer that drafts the plain engine's own continuation, with one token wrong
    in two drafts of every three (the second, then the first), so steps accept all, some
    or none of a draft. Random tiny hybrids never repeat themselves, so n-gram lookup
    alone would draft nothing they accept."""
    def propose(tokens, config, limit):
        for p, out in zip(prompts, outputs):
            if tokens[:len(p)] == p:
                j = len(tokens) - len(p)
                draft = out[j:j + min(limit, config.num_speculative_tokens)]
                wrong = (j % 3 == 1 and len(draft) > 1) + 2 * (j % 3 == 2 and len(draft) > 0)
                if wrong:
                    i = 1 if wrong == 1 else 0
                    draft[i] = (draft[i] + 1) % vocab
                return draft
        raise AssertionError("a sequence no prompt starts")
    return propose


@pytest.mark.parametrize("family,deployment", [("qwen3_5", "embedded"),
                                               ("qwen3_next", "embedded"),
                                               ("qwen3_next", "qfirst")])
def test_hybrid_states_roll_back_to_the_accepted_rows(family, deployment, tiny_checkpoint,
                                                      monkeypatch):
    """Gated DeltaNet hybrids: a draft step runs the recurrence a row at a time and keeps
    each row's conv and recurrent states; after verification the sequence's slot holds
    those after the last accepted row. With drafts accepted whole, in part and not at all,
    greedy and seeded outputs (and logits) are the plain engine's."""
    import services.engine.engine as engine_module
    from services.attention.runner import qfirst_engine
    from services.deployment.transports import make_transport
    from services.mlp_pool import MLPPool

    path, _ = tiny_checkpoint(family)
    model = load_model(path)
    prompts = [prompt(21, seed=1), prompt(9, seed=2), prompt(30, seed=3)]
    params = [GenerationParams(max_tokens=20, ignore_eos=True, return_logits=True)] * 2 + [
        GenerationParams(max_tokens=20, ignore_eos=True, return_logits=True,
                         sampling=SamplingParams(temperature=0.7, seed=3))]
    ref = LLMEngine(model, EngineConfig(block_size=4, num_blocks=256)).generate(prompts, params)
    monkeypatch.setattr(engine_module, "propose", oracle(
        prompts, [r.output_ids for r in ref], model.config.vocab_size))
    if deployment == "qfirst":
        spec = qfirst_engine(model, make_transport("local", [MLPPool(model, "pool-0")]),
                             num_shards=2, block_size=2, num_blocks=256, max_num_seqs=4,
                             speculative=SPEC)
    else:
        spec = LLMEngine(model, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=4,
                                             speculative=SPEC))
    got = spec.generate(prompts, params)
    for g, r in zip(got, ref):
        assert g.output_ids == r.output_ids
        assert (torch.stack(g.logits) - torch.stack(r.logits)).abs().max().item() <= 1e-4
    stats = spec.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert not spec.runner.drafts.pending                  # every draft's states resolved
    assert spec.blocks.num_free == spec.blocks.num_blocks
