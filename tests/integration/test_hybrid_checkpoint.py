"""smollm2-hybrid: the Qwen3.5 checkpoint rebuilt by `make setup` from SmolLM2 and its delta."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models import load_model
from models.config import FULL_ATTENTION
from tools.zoo.derive_hybrid import DELTA, apply_hybrid

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"
HYBRID, PARENT = ZOO / "smollm2-hybrid", ZOO / "smollm2-135m"
TEXT = ("The pickle module implements binary protocols for serializing and de-serializing a "
        "Python object structure.")
# Measured on the test's two held-out windows: 3.38 nat vs the parent's 2.87 (+0.51; KL 0.71;
# the earlier every-fourth-layer stage F 3.43). The bound leaves about 0.5 nat of headroom.
LOSS_MARGIN = 1.0


def test_delta_fits_its_budget():
    assert 0 < DELTA.stat().st_size <= 35 * 2 ** 20


@pytest.mark.slow
def test_layout_is_the_recipes():
    """Attention stays at the layers the delta's recipe names (every fourth layer at its
    phase when it names none); every other layer is Gated DeltaNet."""
    from tools.zoo.derive_hybrid import LEGACY_FA_PHASE, delta_recipe

    recipe = delta_recipe(DELTA)
    fa = recipe.get("fa_layers") or list(range(recipe.get("fa_phase", LEGACY_FA_PHASE), 30, 4))
    cfg = load_model(HYBRID).config
    assert cfg.model_type == "qwen3_5_text" and cfg.is_hybrid
    assert cfg.full_attention_layers == sorted(fa)
    assert cfg.linear_attention_layers == [i for i in range(30) if i not in fa]
    assert 0 < len(fa) <= 10                   # most layers linear, as in Qwen3.5's 3 : 1
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.zero_centered_norm
    assert cfg.rotary_dim == cfg.head_dim == 64


def _hf(dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(HYBRID, dtype=dtype, output_loading_info=True)


@pytest.mark.slow
def test_hf_loads_it_unchanged_and_matches():
    from evals.corpus import documents
    from services.common.tokenizer import load_tokenizer

    hf, info = _hf()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    tok = load_tokenizer(HYBRID)
    ids = torch.tensor([tok(documents("eval")[0].text)["input_ids"][:100]])
    with torch.no_grad():
        ref = hf.eval()(ids).logits
    assert (load_model(HYBRID).forward(ids) - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_every_layer_matches_hf_on_hf_inputs():
    """Layer by layer, fed HF's own hidden states, our layers give HF's next hidden state to
    fp32 rounding. End to end the two can drift further on some texts (about 1e-3 on TEXT):
    the parent's frozen MLPs that create its massive activations (layers 2 and 11, |h| up
    to ~18,000) amplify the ~1e-7 relative rounding differences by a few hundred.
    Per layer the bound is 5e-6 of the row's largest entry: up to 2.8e-6 seen on an AMD EPYC
    (MKL's summation order there differs from HF's in the K = 1536 down projection)."""
    from kernels.attention import get_backend
    from services.common.tokenizer import load_tokenizer

    hf, _ = _hf()
    ours = load_model(HYBRID)
    backend = get_backend(None, ours.device)
    ids = torch.tensor([load_tokenizer(HYBRID)(TEXT)["input_ids"]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        states = hf.eval()(ids, output_hidden_states=True).hidden_states
    for l in range(ours.config.num_hidden_layers - 1):       # the last state is after the norm
        x = states[l]
        if ours.layer(l).kind == "full_attention":
            a = ours.attn_inputs(l, x, pos)
            h = ours.attn_output(l, x, backend.attention_lse(a.q, a.k, a.v, causal=True)[0],
                                 a.gate)
        else:
            inp = ours.gdn_inputs(l, x)
            h = ours.gdn_output(l, x, ours.gdn_mix(l, inp)[0], inp.z)
        ref = states[l + 1][0]
        err, scale = (ours.mlp(l, h)[0] - ref).abs().amax(-1), ref.abs().amax(-1)   # [T]
        assert (err <= 5e-6 * scale + 2e-5).all(), (l, err.max().item())


@pytest.mark.slow
def test_heldout_loss_is_near_the_parent():
    """A real language model: on held-out text its per-token loss stays within a stated
    margin of the parent's (and far from the ~10.8 nat of a uniform guess)."""
    from tools.zoo.derive_hybrid import heldout, heldout_windows
    from services.common.tokenizer import load_tokenizer

    windows = heldout_windows(load_tokenizer(PARENT), n=2, seq_len=256)
    m = heldout(load_model(PARENT), load_model(HYBRID), windows)
    assert m["child_loss"] <= m["parent_loss"] + LOSS_MARGIN


@pytest.mark.slow
def test_rebuild_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    out = apply_hybrid(PARENT, tmp_path / "hybrid")
    assert (out / "config.json").read_text() == (HYBRID / "config.json").read_text()
    a, b = load_file(out / "model.safetensors"), load_file(HYBRID / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_layer_types_keep_every_fourth_layer_at_the_phase():
    from tools.zoo.hybrid_init import layer_types

    assert [i for i, t in enumerate(layer_types(30, 2)) if t == "full_attention"] == \
        [2, 6, 10, 14, 18, 22, 26]
    assert [i for i, t in enumerate(layer_types(30, 3)) if t == "full_attention"] == \
        [3, 7, 11, 15, 19, 23, 27]
    with pytest.raises(ValueError):
        layer_types(30, 4)


def test_layer_types_take_an_explicit_set():
    from tools.zoo.hybrid_init import hybrid_config, layer_types

    kinds = layer_types(30, fa_layers=[3, 17, 18])
    assert [i for i, t in enumerate(kinds) if t == "full_attention"] == [3, 17, 18]
    assert hybrid_config(PARENT, fa_layers=[3, 17, 18])["layer_types"] == kinds
    for bad in ([], [30], [-1]):
        with pytest.raises(ValueError):
            layer_types(30, fa_layers=bad)


def test_choose_layers_keeps_retrieval_layers_then_the_periodic_ones():
    from tools.zoo.retrieval_heads import choose_layers

    scores = torch.zeros(30, 9)
    scores[18, 6], scores[17, 3], scores[23, 2], scores[14, 1] = 0.7, 0.5, 0.4, 0.1
    assert choose_layers(scores, 6, num_retrieval=3) == [3, 7, 11, 17, 18, 23]
    assert choose_layers(scores, 2) == [17, 18]                  # the best two only
    assert choose_layers(scores, 8, num_retrieval=4) == [3, 7, 11, 14, 15, 17, 18, 23]
    assert choose_layers(scores, 7) == [3, 7, 11, 14, 17, 18, 23]   # 4 layers copy at all
    assert choose_layers(torch.zeros(30, 9), 7) == [3, 7, 11, 15, 19, 23, 27]


@pytest.mark.slow
def test_parent_retrieval_heads_sit_in_the_upper_middle_layers():
    """Measured on 4 train-family items: SmolLM2's copying heads are in layers 17-23, where
    Qwen3.5's every-fourth-layer rule keeps only 19 and 23; the lowest layers do not copy."""
    from services.common.tokenizer import load_tokenizer
    from tools.zoo.retrieval_heads import copy_scores, train_items

    items = train_items(load_tokenizer(PARENT), 4, 512, seed=1)
    scores, steps = copy_scores(load_model(PARENT), items)
    best = scores.max(-1).values
    assert steps >= 8
    assert ((0 <= scores) & (scores <= 1)).all()
    assert best[17:24].max() >= 0.3 and best[:6].max() < 0.15
    assert int(best.argmax()) in range(17, 24)


def test_induction_heads_of_the_parent_and_the_hybrid():
    """On random tokens repeated: SmolLM2's induction heads sit in layers 17 and 18 with a
    strong previous-token head just below (16), none in the bottom layers, and it copies the
    second copy; a hybrid has scores only where it keeps attention."""
    from tools.zoo.retrieval_heads import induction_scores

    parent = load_model(PARENT)
    induction, previous, copy = induction_scores(parent, n=120)
    best, prev = induction.max(-1).values, previous.max(-1).values
    assert ((0 <= induction) & (induction <= 1)).all() and ((0 <= previous) & (previous <= 1)).all()
    assert best[17] > 0.5 and best[18] > 0.5 and best[:12].max() < 0.1
    assert prev[16] > 0.5 and prev[0] < 0.2
    assert int(best.argmax()) in (17, 18)
    assert copy > 0.5              # the first copy, unpredictable, would score about 0
    hybrid = load_model(HYBRID)
    h_induction = induction_scores(hybrid, n=120).induction
    kept = [kind == FULL_ATTENTION for kind in hybrid.config.layer_types]
    assert [not row.isnan().any().item() for row in h_induction] == kept
    assert all(row.isnan().all() for row, k in zip(h_induction, kept) if not k)


def test_hex_copying_rests_on_layer_16s_previous_token_head():
    """Random hex characters (a UUID's alphabet, one token each) repeated: SmolLM2 copies
    them; zeroing the previous-token head 16:0 breaks that, zeroing a head of layer 3 does
    not, and the hook is gone after the block. GDN layers and bad heads are refused."""
    from services.common.tokenizer import load_tokenizer
    from tools.zoo.retrieval_heads import ablated, induction_scores, single_char_ids

    parent = load_model(PARENT)
    hex_ids = single_char_ids(load_tokenizer(PARENT))
    assert len(hex_ids) == 16 and len(set(hex_ids.tolist())) == 16
    base = induction_scores(parent, n=120, alphabet=hex_ids)
    with ablated(parent, [(16, 0)]):
        cut = induction_scores(parent, n=120, alphabet=hex_ids)
    with ablated(parent, [(3, 0)]):
        other = induction_scores(parent, n=120, alphabet=hex_ids)
    again = induction_scores(parent, n=120, alphabet=hex_ids)
    assert base.copy > 0.8 and cut.copy < base.copy - 0.3
    assert abs(other.copy - base.copy) < 0.1 and again.copy == base.copy
    assert cut.previous[16, 0] == base.previous[16, 0]     # its pattern stays, its output goes
    with ablated(parent, [(16, None)]):                    # the whole layer, that head with it
        assert induction_scores(parent, n=120, alphabet=hex_ids).copy < base.copy - 0.3
    hybrid = load_model(HYBRID)
    gdn = hybrid.config.layer_types.index(next(k for k in hybrid.config.layer_types
                                               if k != FULL_ATTENTION))
    for heads in ([(gdn, 0)], [(16, parent.config.num_attention_heads)], [(99, 0)]):
        with pytest.raises(ValueError):
            with ablated(hybrid if heads[0][0] == gdn else parent, heads):
                pass


def test_repeated_passage_haystack_repeats_one_short_passage():
    import random

    from services.common.tokenizer import load_tokenizer
    from tools.zoo.derive import needle_batch, repeated_passage

    tok = load_tokenizer(PARENT)
    filler = tok(TEXT * 40, add_special_tokens=False)["input_ids"]
    hay = repeated_passage(tok, filler, random.Random(0), 300)
    period = next(p for p in range(1, 81) if hay[p:] == hay[:-p])
    assert len(hay) >= 300 and period <= 80
    ids, mask = needle_batch(tok, filler, 256, random.Random(3), repeated_share=1.0)
    assert ids.shape[1] <= 256 and 1 <= int(mask.sum()) <= 12


def test_varied_needle_formats_add_codes_and_single_statements():
    """`--needle-formats varied`: serial-code answers (longer than 8 tokens fit whole) and
    needles stated once appear; the answer mask covers the appended answer exactly."""
    import random

    from services.common.tokenizer import load_tokenizer
    from tools.zoo.derive import needle_batch

    tok = load_tokenizer(PARENT)
    filler = tok(TEXT * 40, add_special_tokens=False)["input_ids"]
    rng, codes, once = random.Random(0), 0, 0
    for _ in range(24):
        ids, mask = needle_batch(tok, filler, 300, rng, formats="varied")
        assert ids.shape[1] <= 300
        value = tok.decode(ids[0][mask.nonzero()[:, 0] + 1]).strip().rstrip(".")
        text = tok.decode(ids[0])
        codes += "-" in value
        once += text.count(value) == 2          # the needle once, the answer once
    assert codes >= 3 and once >= 3
    with pytest.raises(ValueError, match="formats"):
        needle_batch(tok, filler, 300, rng, formats="fancy")


def test_copy_items_write_one_span_twice_and_mask_the_second_copy():
    """`copy_batch`: exactly seq_len tokens; the span sits once in the first half and again
    at the end; the mask covers the positions that predict the second copy's tokens after
    its first (so ids[mask + 1] is the span without its first token); both kinds of span
    (word pieces, single letters and digits) appear."""
    import random

    from services.common.tokenizer import load_tokenizer
    from tools.zoo.derive import COPY_CHARS, copy_batch

    tok = load_tokenizer(PARENT)
    filler = tok(TEXT * 40, add_special_tokens=False)["input_ids"]
    chars = {tok.convert_tokens_to_ids(c) for c in COPY_CHARS}
    rng, kinds = random.Random(0), set()
    for _ in range(24):
        ids, mask = copy_batch(tok, filler, 256, rng)
        ids = ids[0].tolist()
        assert len(ids) == 256 and len(mask) == 256
        at = int(mask.nonzero()[0, 0])
        n = int(mask.sum()) + 1
        span = ids[at:at + n]
        assert [ids[i + 1] for i in mask.nonzero()[:, 0].tolist()] == span[1:]
        first = next(i for i in range(len(ids)) if ids[i:i + n] == span)
        assert first + n <= 128 and at >= 256 - n - 8 and first < at
        kinds.add(set(span) <= chars)
    assert kinds == {True, False}
    with pytest.raises(ValueError, match="no text"):
        copy_batch(tok, filler, 30, random.Random(1))


@pytest.mark.slow
def test_distillation_steps_run_and_train(tmp_path):
    """`derive hybrid` trains through the chunked delta rule: two logit steps continued
    from the zoo's delta (one retrieval item, short windows) run, write a delta that
    records them, and move the trained tensors."""
    from safetensors.torch import load_file

    from tools.zoo.derive_hybrid import derive_hybrid

    delta = tmp_path / "delta.safetensors"
    recipe = derive_hybrid(PARENT, tmp_path / "out", init_delta=DELTA, steps=2, seq_len=64,
                           needle_frac=0.5, needle_len=160, kl_lr=1e-3, seed=5,
                           delta_path=delta, log=lambda *_: None)
    assert recipe["steps"] == 2 and recipe["continued_from"] is not None
    before, after = load_file(DELTA), load_file(delta)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert load_model(tmp_path / "out").config.layer_types == \
        load_model(HYBRID).config.layer_types
    # copying items: the share is recorded with their KL; shares over 1 are refused
    recipe = derive_hybrid(PARENT, tmp_path / "out2", init_delta=DELTA, steps=2, seq_len=64,
                           copy_frac=1.0, needle_len=128, kl_lr=1e-3, seed=5,
                           delta_path=tmp_path / "d2.safetensors", log=lambda *_: None)
    assert recipe["copy_frac"] == 1.0 and recipe["copy_kl_last10"] > 0
    with pytest.raises(ValueError, match="over 1"):
        derive_hybrid(PARENT, tmp_path / "out3", init_delta=DELTA, steps=1, seq_len=64,
                      needle_frac=0.6, copy_frac=0.6, delta_path=tmp_path / "d3.safetensors",
                      log=lambda *_: None)
