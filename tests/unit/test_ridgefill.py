"""RidgeFill: calibration maths and storage, the fill prefill, its settings, the served path."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from evals.ridgefill_arms import SplicedFill, greedy_from_prefill, map_cost_ratio
from services.common.messages import PrefillRequest
from services.engine import EngineConfig, GenerationParams, LLMEngine
from services.prefill.capture import exact_pass
from services.prefill.maps import MapsError, RidgeMaps, context_features
from services.prefill.ridgefill import RidgeFill
from services.prefill.service import PrefillConfig, PrefillService
from services.prefill.settings import FillError, FillSettings
from tests.helpers.ridgefill import FAMILIES, prompt
from tools.calibration import (CalibConfig, Moments, calibrate, calibrate_terminal, heldout_error,
                               resolve, solve)


# ---- fill disabled == exact engine, bitwise ------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["split=L", "tail>=N"])
def test_disabled_fill_is_bitwise_the_exact_engine(four_layer, family, how):
    model, maps_dir = four_layer(family)
    L, ids = model.config.num_hidden_layers, prompt(150)
    settings = FillSettings(split=L, tail=0) if how == "split=L" else FillSettings(split=1,
                                                                                     tail=150)
    engine = LLMEngine(model, EngineConfig(max_prefill_chunk=4096, max_num_batched_tokens=4096,
                                           num_blocks=32))
    sid = engine.add_request(ids, GenerationParams(max_tokens=2, return_logits=True))
    engine.step()                                   # the whole prompt, one chunk, one token
    seq = engine.seqs[sid]
    res = RidgeFill(model, RidgeMaps(maps_dir, model, 1)).prefill(ids, settings)
    assert res.num_filled == 0
    pos = torch.arange(150)
    slots = torch.tensor(seq.block_table)[pos // 16] * 16 + pos % 16
    for l in res.k:
        kvh, d = res.k[l].shape[1:]
        assert torch.equal(engine.cache.k(l).reshape(-1, kvh, d)[slots], res.k[l])
        assert torch.equal(engine.cache.v(l).reshape(-1, kvh, d)[slots], res.v[l])
    for l in res.conv:
        gi = engine.cache.gdn_index[l]
        assert torch.equal(engine.cache.conv[gi, seq.state_slot], res.conv[l])
        assert torch.equal(engine.cache.recurrent[gi, seq.state_slot], res.recurrent[l])
    assert torch.equal(seq.logits[0], res.logits[0])


# ---- the fill machinery against exact ------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_every_prefix_row_selected_is_exact(four_layer, family):
    """budget 1: all prefix rows exact, so masks, GDN ordering and scatter must be right."""
    model, maps_dir = four_layer(family)
    ids = prompt(120, seed=1)
    exact = model.forward(torch.tensor([ids]), last_n=8)[0]
    rf = RidgeFill(model, RidgeMaps(maps_dir, model, 1))
    for selector in ("random", "attention"):
        res = rf.prefill(ids, FillSettings(split=1, tail=16, selector=selector, budget=1.0),
                         n_logits=8)
        assert res.num_filled == 0
        torch.testing.assert_close(res.logits, exact, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_last_layer_split_fills_exactly(four_layer, family):
    """S = L−1: the only upper layer reads x_S itself, so filled KV / GDN inputs are exact."""
    model, _ = four_layer(family)
    L, ids = model.config.num_hidden_layers, prompt(100, seed=2)
    res = RidgeFill(model).prefill(ids, FillSettings(split=L - 1, tail=10, fill="identity"),
                                   n_logits=10)
    assert res.num_filled == 90
    exact = model.forward(torch.tensor([ids]), last_n=10)[0]
    torch.testing.assert_close(res.logits, exact, atol=1e-4, rtol=0)


def test_splice_of_exact_keys_and_values_restores_a_dense_model(four_layer):
    model, maps_dir = four_layer("qwen3")
    ids = prompt(100, seed=3)
    maps = RidgeMaps(maps_dir, model, 1)
    exact = model.forward(torch.tensor([ids]), last_n=4)[0]
    s = FillSettings(split=1, tail=12)
    filled = RidgeFill(model, maps).prefill(ids, s, n_logits=4).logits
    spliced = SplicedFill(model, maps, splice="kv").prefill(ids, s, n_logits=4).logits
    assert (filled - exact).abs().max() > 1e-2          # the fill really changes the output
    torch.testing.assert_close(spliced, exact, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_fill_arms_write_what_they_claim(four_layer, family):
    model, maps_dir = four_layer(family)
    ids = prompt(90, seed=4)
    rf = RidgeFill(model, RidgeMaps(maps_dir, model, 1))
    fa_upper = [l for l in model.config.full_attention_layers if l >= 1]
    none = rf.prefill(ids, FillSettings(split=1, tail=10, fill="none"))
    for l in fa_upper:
        assert not none.valid[l][:80].any() and none.valid[l][80:].all()
    ident = rf.prefill(ids, FillSettings(split=1, tail=10, fill="identity"))
    ridge = rf.prefill(ids, FillSettings(split=1, tail=10, fill="ridge"))
    for l in fa_upper:
        if l == 1:      # layer S reads x_S itself under both fills: identical keys
            assert torch.equal(ident.k[l], ridge.k[l])
        else:
            assert not torch.equal(ident.k[l][:80], ridge.k[l][:80])
    assert ridge.num_filled == 80 and ridge.exact_rows.tolist() == list(range(80, 90))


def test_selectors_pick_budgeted_prefix_rows(four_layer):
    model, maps_dir = four_layer("qwen3")
    ids = prompt(200, seed=5)
    rf = RidgeFill(model, RidgeMaps(maps_dir, model, 1), unigram=torch.ones(1024),
                   token_class=torch.randint(0, 5, (1024,), generator=torch.Generator()
                                             .manual_seed(0)).to(torch.int8))
    seen = {}
    for sel in ("attention", "question-blind", "random", "probe", "protected"):
        # (random weights have no tokenizer: the probe ranks by attention alone)
        res = rf.prefill(ids, FillSettings(split=1, tail=40, selector=sel, budget=0.1,
                                           lexical=0))
        rows = res.exact_rows[res.exact_rows < 160]
        assert rows.numel() <= 16 and (rows >= 0).all() and rows.unique().numel() == rows.numel()
        if sel != "protected":
            assert rows.numel() == 16
        seen[sel] = rows.tolist()
    assert seen["attention"] != seen["random"]
    again = rf.prefill(ids, FillSettings(split=1, tail=40, selector="random", seed=0))
    other = rf.prefill(ids, FillSettings(split=1, tail=40, selector="random", seed=1))
    assert again.exact_rows.tolist() == seen["random"] + list(range(160, 200))
    assert other.exact_rows.tolist() != again.exact_rows.tolist()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("tail,probe_rows", [(40, 32), (20, 64)])
def test_probe_reuses_its_filled_rows_in_the_second_sweep(four_layer, family, tail,
                                                          probe_rows):
    """The probe's sweep fills every prefix row before its own; the second sweep takes its
    filled rows' K/V and GDN inputs from it instead of recomputing them: the same rows,
    KV, states and logits as recomputing (fp32 rounding of a different batch size). With
    more probe rows than tail rows some filled rows lie past the probe's fill and are
    computed afresh. With fewer, the tail rows before the probe's are filled in its sweep
    (they once held uninitialised keys there, and the probe picked different rows each
    call: the two prefills below would not pick the same rows)."""
    model, maps_dir = four_layer(family)
    ids = prompt(200, seed=7)
    rf = RidgeFill(model, RidgeMaps(maps_dir, model, 2))
    s = FillSettings(split=2, tail=tail, selector="probe", budget=0.2, probe_rows=probe_rows,
                     lexical=0)
    calls = []
    real = rf._fill_input

    def counting(s_, l, feats):
        calls.append(l)
        return real(s_, l, feats)
    rf._fill_input = counting
    got = rf.prefill(ids, s)
    reused = list(calls)
    rf.reuse_probe_fills = False
    calls.clear()
    ref = rf.prefill(ids, s)
    assert torch.equal(got.exact_rows, ref.exact_rows) and got.num_filled == ref.num_filled
    for l in ref.k:
        assert torch.allclose(got.k[l], ref.k[l], atol=1e-5)
        assert torch.allclose(got.v[l], ref.v[l], atol=1e-5)
    for l in ref.recurrent:
        assert torch.allclose(got.recurrent[l], ref.recurrent[l], atol=1e-5)
    assert torch.allclose(got.logits, ref.logits, atol=1e-4)
    # recomputing maps the filled rows of every upper layer in both sweeps
    upper = list(range(2, model.config.num_hidden_layers))
    assert calls == upper + upper
    assert reused == (upper if probe_rows <= tail else upper + upper)


def test_longtail_control_pays_for_gated_deltanet_fills(four_layer):
    """A filled row in a GDN layer costs its input projection and state update, not only
    K/V: the equal-cost longer tail grows with the GDN share of the upper layers; on a
    dense model the split does not matter."""
    dense, _ = four_layer("llama3")
    assert map_cost_ratio(dense, split=1) == pytest.approx(map_cost_ratio(dense))
    hybrid, _ = four_layer("qwen3_5")
    c = hybrid.config
    assert c.linear_attention_layers == [0, 1, 2] and c.full_attention_layers == [3]
    only_fa, with_gdn = map_cost_ratio(hybrid, split=3), map_cost_ratio(hybrid, split=2)
    d = c.hidden_size
    fa_fill = d * d + 2 * d * c.num_key_value_heads * c.head_dim
    gdn_fill = (d * d + d * (c.gdn_conv_dim + 2 * c.linear_num_value_heads)
                + 2 * c.linear_num_value_heads * c.linear_key_head_dim
                * c.linear_value_head_dim)
    assert with_gdn / only_fa == pytest.approx((fa_fill + gdn_fill) / 2 / fa_fill)
    assert with_gdn > only_fa


def test_protected_selector_takes_the_rarest_of_each_class(four_layer):
    model, _ = four_layer("qwen3")
    ids = [5] * 40 + [7] * 40 + [9] * 20 + [11] * 20 + list(range(100, 120))
    counts = torch.full((1024,), 1000.0)
    counts[9], counts[11] = 1.0, 2.0                      # 9 is the rarest, then 11
    cls = torch.zeros(1024, dtype=torch.int8)
    cls[[5, 7, 9, 11]] = 1
    rf = RidgeFill(model, unigram=counts, token_class=cls)
    res = rf.prefill(ids, FillSettings(split=1, tail=20, fill="identity",
                                       selector="protected", budget=1.0))
    rows = res.exact_rows[res.exact_rows < 120].tolist()
    # 25% of the 120 class-1 prefix rows: every 9 (the rarest), then ten of the 11s
    assert len(rows) == 30 and rows[:20] == list(range(80, 100))
    assert all(100 <= r < 120 for r in rows[20:])


# ---- calibration -----------------------------------------------------------------------
def test_streamed_moments_solve_the_dense_ridge_problem():
    g = torch.Generator().manual_seed(0)
    d, lam = 12, 0.01
    w = torch.randn(d, d, generator=g)
    m = Moments(d, (3,))
    xs, ys = [], []
    for _ in range(5):
        x = torch.randn(50, d, generator=g) * 3 + 40         # large mean: no cancellation
        y = x @ w.T + 0.3 * torch.randn(50, d, generator=g) + 5
        m.add(x, {3: y})
        xs.append(x.double())
        ys.append(y.double())
    x, y = torch.cat(xs), torch.cat(ys)
    xc, yc = x - x.mean(0), y - y.mean(0)
    alpha = lam * torch.trace(xc.T @ xc) / d
    a = yc.T @ xc @ torch.linalg.inv(xc.T @ xc + alpha * torch.eye(d, dtype=torch.float64))
    b = y.mean(0) - a @ x.mean(0)
    a2, b2 = solve(m, lam)[3]
    torch.testing.assert_close(a2, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b2, b, atol=1e-3, rtol=1e-5)
    # the held-out error computed from sums equals the direct one
    hx = torch.randn(50, d, generator=g) * 3 + 40
    hy = hx @ w.T + 0.3 * torch.randn(50, d, generator=g) + 5
    h2 = Moments(d, (3,))
    h2.add(hx, {3: hy})
    resid = hy.double() - (hx.double() @ a2.T + b2)
    direct = (resid ** 2).sum() / ((hy.double() - hy.double().mean(0)) ** 2).sum()
    assert heldout_error({3: (a2, b2)}, h2) == pytest.approx(float(direct), rel=1e-4)  # fp32 chunk products


def test_sink_rows_stay_out_of_the_fit_and_exact(four_layer, tmp_path, monkeypatch):
    """The first rows of every calibration sequence never enter the sums (a huge first row
    changes nothing), and a ridge fill keeps them exact: their keys are the exact engine's."""
    model, _ = four_layer("llama3")
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 1000, (200,), generator=g).tolist() for _ in range(4)]
    cfg = CalibConfig(splits=(1,), max_len=100, heldout_docs=1)           # sink_rows = 4
    assert cfg.sink_rows == 4
    calibrate(model, iter(docs), cfg, tmp_path / "a", log=lambda *_: None)
    import services.prefill.capture as capture
    real = capture.exact_pass

    def huge_first_rows(m, ids, **kw):            # a massive-activation sink at row 0
        xs, kv = real(m, ids, **kw)
        scale = torch.ones(ids.shape[0], 1)
        scale[0] = 1e4
        return [x * scale for x in xs], kv

    monkeypatch.setattr(capture, "exact_pass", huge_first_rows)
    calibrate(model, iter(docs), cfg, tmp_path / "b", log=lambda *_: None)
    calibrate(model, iter(docs), dataclasses.replace(cfg, sink_rows=0), tmp_path / "c",
              log=lambda *_: None)
    monkeypatch.undo()
    a, b, c = (load_file(str(tmp_path / d / "stats-S1.safetensors")) for d in "abc")
    assert a["fit.n"].item() == 3 * 2 * (100 - 4)       # 3 fit docs, 2 sequences each
    assert torch.equal(a["fit.sxx"], b["fit.sxx"]) and torch.equal(a["fit.sxy.3"], b["fit.sxy.3"])
    assert c["fit.n"].item() == 3 * 200 and not torch.allclose(a["fit.sxx"], c["fit.sxx"])
    maps = RidgeMaps(tmp_path / "a", model, 1)
    assert maps.sink_rows == 4 and RidgeMaps.layout_of(tmp_path / "a", 1) == (4, 0)
    ids = prompt(90, seed=2)
    res = RidgeFill(model, maps).prefill(ids, FillSettings(split=1, tail=10))
    assert res.exact_rows.tolist() == [0, 1, 2, 3] + list(range(80, 90))
    assert res.num_filled == 76
    exact = RidgeFill(model).prefill(ids, FillSettings(split=4, tail=0))
    for l in model.config.full_attention_layers:
        torch.testing.assert_close(res.k[l][:4], exact.k[l][:4], atol=1e-5, rtol=0)
        if l > 1:
            assert not torch.allclose(res.k[l][4:80], exact.k[l][4:80], atol=1e-3)
    # identity fill has no maps to answer for: it keeps only the rows asked for
    assert RidgeFill(model, maps).prefill(ids, FillSettings(split=1, tail=10, fill="identity")) \
        .num_filled == 80


def test_context_rows_put_the_previous_split_state_beside_the_row():
    x = torch.arange(12.0).view(4, 3)
    f = context_features(x, torch.tensor([0, 2, 3]), 2)
    assert f.shape == (3, 9)
    assert f[0].tolist() == [0, 1, 2] + [0] * 6                       # nothing before row 0
    assert f[1].tolist() == [6, 7, 8, 3, 4, 5, 0, 1, 2]              # x[2], x[1], x[0]
    assert torch.equal(context_features(x, torch.tensor([1, 3]), 0), x[[1, 3]])
    # a target that needs the previous row: the map with one context row recovers it
    g = torch.Generator().manual_seed(0)
    d = 6
    w0, w1 = torch.randn(d, d, generator=g), torch.randn(d, d, generator=g)
    seq = torch.randn(400, d, generator=g)
    y = seq @ w0.T
    y[1:] += seq[:-1] @ w1.T
    rows = torch.arange(1, 400)
    m0, m1 = Moments(d, (2,)), Moments(d, (2,), d_in=2 * d)
    m0.add(context_features(seq, rows, 0), {2: y[1:]})
    m1.add(context_features(seq, rows, 1), {2: y[1:]})
    a1, _ = solve(m1, 1e-8)[2]
    torch.testing.assert_close(a1.float(), torch.cat([w0, w1], 1), atol=1e-4, rtol=0)
    assert heldout_error(solve(m1, 1e-8), m1) < 1e-8 < 0.3 < heldout_error(solve(m0, 1e-8), m0)


def test_fill_with_context_maps_reads_the_row_before(four_layer, tmp_path):
    """Filled keys are K(norm(A [x_S[t], x_S[t−1]] + b)), from maps calibrated so."""
    model, _ = four_layer("llama3")
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 1000, (200,), generator=g).tolist() for _ in range(4)]
    calibrate(model, iter(docs), CalibConfig(splits=(1,), max_len=100, heldout_docs=1,
                                             context_rows=1), tmp_path, log=lambda *_: None)
    maps = RidgeMaps(tmp_path, model, 1)
    assert maps.context_rows == 1 and maps.get(3)[0].shape == (128, 256)
    assert RidgeMaps.layout_of(tmp_path, 1) == (4, 1) and RidgeMaps.layout_of(tmp_path, 2) == (0, 0)
    # the longer-tail control arm pays for the wider map: d² more multiply-adds per row
    d = model.config.hidden_size
    per_madd = map_cost_ratio(model) / (d * d + 2 * d * model.config.num_key_value_heads
                                        * model.config.head_dim)
    assert map_cost_ratio(model, 1) - map_cost_ratio(model) == pytest.approx(d * d * per_madd)
    ids = prompt(60, seed=3)
    res = RidgeFill(model, maps).prefill(ids, FillSettings(split=1, tail=10))
    assert res.num_filled == 50 - 4                                       # 4 sink rows exact
    xs, _ = exact_pass(model, torch.tensor(ids))
    a, b = maps.get(3)
    rows = torch.arange(4, 50)
    xhat = torch.cat([xs[1][rows], xs[1][rows - 1]], 1) @ a.T + b
    k, _ = model.attn_key_value(3, model.norm_in(3, xhat), rows)
    torch.testing.assert_close(res.k[3][4:50], k, atol=1e-5, rtol=0)
    # identity fill ignores the maps' context rows: x̂ = x_S of the row itself
    ident = RidgeFill(model, maps).prefill(ids, FillSettings(split=1, tail=10, fill="identity"))
    plain = RidgeFill(model).prefill(ids, FillSettings(split=1, tail=10, fill="identity"))
    torch.testing.assert_close(ident.k[3], plain.k[3], atol=0, rtol=0)
    with pytest.raises(MapsError, match="context_rows"):
        calibrate(model, iter(docs), CalibConfig(splits=(1,), context_rows=-1), tmp_path / "x")


def test_new_lambda_resolves_from_saved_sums_without_data(four_layer, tmp_path, monkeypatch):
    model, maps_dir = four_layer("qwen3")
    before = RidgeMaps(maps_dir, model, 1).get(3)[0].clone()
    import services.prefill.capture as capture
    monkeypatch.setattr(capture, "exact_pass", lambda *a, **k: pytest.fail("re-read data"))
    info = resolve(maps_dir, 1, lam=0.9)
    assert info["lambda"] == 0.9
    after = RidgeMaps(maps_dir, model, 1).get(3)[0]
    assert not torch.equal(before, after)
    resolve(maps_dir, 1)                             # back to the held-out choice


def test_int8_maps_match_bf16_maps(four_layer, tmp_path):
    model, maps_dir = four_layer("llama3")
    bf16 = RidgeMaps(maps_dir, model, 1).get(2)[0]
    resolve(maps_dir, 1, map_dtype="int8")
    try:
        q = RidgeMaps(maps_dir, model, 1, resident=False)
        int8 = q.get(2)[0]
        assert q.file_bytes < bf16.numel() * 2 * 3     # int8 storage, not fp32
        assert (int8 - bf16).abs().max() <= bf16.abs().max() / 100
    finally:
        resolve(maps_dir, 1, map_dtype="bf16")


def test_maps_refuse_another_model_or_split(four_layer):
    model, maps_dir = four_layer("qwen3")
    other, _ = four_layer("llama3")
    with pytest.raises(MapsError, match="calibrated for model"):
        RidgeMaps(maps_dir, other, 1)
    with pytest.raises(MapsError, match="no maps for split 3"):
        RidgeMaps(maps_dir, model, 3)
    rf = RidgeFill(model, RidgeMaps(maps_dir, model, 2))
    with pytest.raises(FillError, match="calibrated for split 2"):
        rf.prefill(prompt(50), FillSettings(split=1, tail=8))


def test_terminal_offsets_are_the_mean_state_gap(four_layer):
    model, maps_dir = four_layer("qwen3_next")
    ids = prompt(120, seed=7)
    calibrate_terminal(model, maps_dir, 1, [ids], tail=20, log=lambda *_: None)
    maps = RidgeMaps(maps_dir, model, 1)
    exact = RidgeFill(model).prefill(ids, FillSettings(split=4, tail=0), record_state_at=100)
    filled = RidgeFill(model, maps).prefill(ids, FillSettings(split=1, tail=20),
                                            record_state_at=100)
    upper = [l for l in model.config.linear_attention_layers if l > 1]
    assert upper
    for l in upper:
        torch.testing.assert_close(maps.delta_state(l),
                                   exact.prefix_recurrent[l] - filled.prefix_recurrent[l])
    corrected = RidgeFill(model, maps).prefill(
        ids, FillSettings(split=1, tail=20, terminal_correction=True), n_logits=20)
    plain = RidgeFill(model, maps).prefill(ids, FillSettings(split=1, tail=20), n_logits=20)
    ref = model.forward(torch.tensor([ids]), last_n=20)[0]
    # every prefix row is filled, so ρ = 1 and the prefix-end state becomes exact
    assert (corrected.logits - ref).abs().mean() < (plain.logits - ref).abs().mean()


# ---- settings are checked before any work ----------------------------------------------
def test_bad_settings_fail_before_work(four_layer, monkeypatch):
    model, maps_dir = four_layer("qwen3")
    svc = PrefillService(model, PrefillConfig(maps_dir=str(maps_dir), split=2, tail=8))
    calls = []
    monkeypatch.setattr(model, "embed", lambda *a: calls.append(1))
    bad = [{"split": 0}, {"split": 5}, {"tail": -1}, {"budget": 1.5}, {"selector": "psychic"},
           {"fill": "none"}, {"value_rescale": -2}, {"bogus": 1}, {"split": 3}]
    for overrides in bad:
        with pytest.raises(ValueError):
            svc.resolve("ridgefill", overrides, 100)
    # JSON of the wrong type: refused as FillError naming the field, not met as a TypeError
    wrong_type = {"split": True, "tail": "8", "budget": "0.1", "value_rescale": 2.0,
                  "key_rescale": -1, "terminal_correction": "yes", "seed": None,
                  "selector": ["probe"], "sink_rows": 1.5, "lexical": None,
                  "lexical_rank": "tfidf"}
    for field, value in wrong_type.items():
        with pytest.raises(FillError, match=field):
            svc.resolve("ridgefill", {field: value}, 100)
    for field in ("budget", "lexical"):
        with pytest.raises(FillError, match=field if field == "lexical" else "budget"):
            svc.resolve("ridgefill", {field: float("nan")}, 100)
    with pytest.raises(ValueError, match="prefill_mode"):
        PrefillRequest("fast")
    engine = LLMEngine(model, EngineConfig(num_blocks=32), prefill_service=svc)
    with pytest.raises(ValueError, match="split"):
        engine.add_request(prompt(40), GenerationParams(
            prefill=PrefillRequest("ridgefill", {"split": 7, "tail": 4})))
    assert not calls and not engine.has_unfinished()


def test_server_defaults_are_checked_at_startup_whenever_maps_are_given(four_layer):
    """With --maps, requests may ask for RidgeFill even when exact is the default mode:
    bad defaults (or defaults without maps) refuse to start rather than fail every such
    request."""
    model, maps_dir = four_layer("qwen3")
    for mode in ("exact", "ridgefill"):
        with pytest.raises(FillError, match="budget"):
            PrefillService(model, PrefillConfig(mode=mode, maps_dir=str(maps_dir), split=2,
                                                tail=8, budget=5.0))
        with pytest.raises(ValueError, match="split 3"):
            PrefillService(model, PrefillConfig(mode=mode, maps_dir=str(maps_dir), split=3))
    PrefillService(model, PrefillConfig(mode="exact", split=3, budget=5.0))   # no maps: unused


def test_served_ridgefill_matches_the_eval_decode_and_frees_blocks(four_layer):
    """Engine + prefill service (the served path) == RidgeFill + greedy decode (eval)."""
    for family in ("qwen3", "qwen3_next"):
        model, maps_dir = four_layer(family)
        svc = PrefillService(model, PrefillConfig(mode="ridgefill", maps_dir=str(maps_dir),
                                                  split=1, tail=12, selector="attention"))
        engine = LLMEngine(model, EngineConfig(num_blocks=48, max_prefill_chunk=32,
                                               max_num_batched_tokens=64), prefill_service=svc)
        prompts = [prompt(130, seed=8), prompt(60, seed=9), prompt(100, seed=10)]
        rf = svc.resolve(None, None, 130)          # the server's default: RidgeFill
        params = [GenerationParams(max_tokens=6, ignore_eos=True, prefill=p)
                  for p in (None, PrefillRequest("exact"), None)]
        seqs = engine.generate(prompts, params)
        for ids, seq, p in zip(prompts, seqs, params):
            if p.prefill is not None:
                continue
            res = svc.prefill(ids, rf)
            assert seq.output_ids == greedy_from_prefill(model, res, len(ids), 6)
        plain = LLMEngine(model, EngineConfig(num_blocks=48)).generate(
            [prompts[1]], GenerationParams(max_tokens=6, ignore_eos=True))[0]
        assert seqs[1].output_ids == plain.output_ids
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_grouped_attention_of_exact_rows_equals_one_pass(four_layer):
    """Exact rows attend in groups over the keys up to each group's last row: the same
    output as one pass under the whole [E, N] mask."""
    model, _ = four_layer("llama3")
    g = torch.Generator().manual_seed(0)
    n, h, kv, d = 300, 4, 2, 32
    pos = torch.cat([torch.tensor([0, 1, 2, 3, 40, 41, 90, 150, 151, 199]), torch.arange(260, 300)])
    q = torch.randn(pos.numel(), h, d, generator=g)
    k, v = torch.randn(n, kv, d, generator=g), torch.randn(n, kv, d, generator=g)
    valid = torch.rand(n, generator=g) > 0.2
    valid[pos] = True
    mask = (torch.arange(n)[None, :] <= pos[:, None]) & valid[None, :]
    rf = RidgeFill(model)
    whole = rf._attend(q, k, v, mask, pos, group=10 ** 6)
    ref, _ = rf.attn.attention_lse(q[None], k[None], v[None], mask=mask[None])
    torch.testing.assert_close(whole, ref[0])
    for group in (1, 3, 7, 256):
        torch.testing.assert_close(rf._attend(q, k, v, mask, pos, group=group), ref[0],
                                   atol=1e-5, rtol=1e-5)


def test_compute_share_bound():
    s = FillSettings(split=12, tail=4096)
    assert s.compute_share(32, 16384) == pytest.approx(12 / 32 + (20 / 32) * 4096 / 16384)
    assert dataclasses.replace(s, tail=20000).compute_share(32, 16384) == 1.0
    probe = dataclasses.replace(s, selector="probe", budget=0.3)    # + 30% of the prefix
    rows = 4096 + round(0.3 * (16384 - 4096))
    assert probe.compute_share(32, 16384) == pytest.approx(12 / 32 + (20 / 32) * rows / 16384)


def test_rescale_multiplies_filled_rows_by_one_factor_per_kv_head(four_layer):
    model, maps_dir = four_layer("qwen3")
    ids = prompt(100, seed=11)
    rf = RidgeFill(model, RidgeMaps(maps_dir, model, 1))
    base = rf.prefill(ids, FillSettings(split=1, tail=20))
    both = rf.prefill(ids, FillSettings(split=1, tail=20, value_rescale=8, key_rescale=True))
    only_v = rf.prefill(ids, FillSettings(split=1, tail=20, value_rescale=8))
    for t, name in ((both.k[2], "k"), (both.v[2], "v")):      # layer 2: the first l > S
        ref = base.k[2] if name == "k" else base.v[2]
        ratio = t[:80].norm(dim=-1) / ref[:80].norm(dim=-1)     # [80, KV]
        assert (ratio.std(0) < 1e-4).all() and ((ratio[0] - 1).abs() > 1e-3).any()
        assert torch.equal(t[80:], ref[80:])                    # exact rows untouched
    assert torch.equal(only_v.k[2], base.k[2])
    only_k = rf.prefill(ids, FillSettings(split=1, tail=20, key_rescale=8))
    assert torch.equal(only_k.v[2], base.v[2]) and torch.equal(only_k.k[2], both.k[2])
    # separate row counts: each scale from its own first c tail rows
    v4 = rf.prefill(ids, FillSettings(split=1, tail=20, value_rescale=4))
    mixed = rf.prefill(ids, FillSettings(split=1, tail=20, value_rescale=4, key_rescale=8))
    assert torch.equal(mixed.v[2], v4.v[2]) and torch.equal(mixed.k[2], only_k.k[2])
    assert not torch.equal(v4.v[2], only_v.v[2])          # 4 rows give another scale than 8
    with pytest.raises(FillError, match="key_rescale"):
        FillSettings(split=1, tail=20, key_rescale=True).validate(4)
    with pytest.raises(FillError, match="key_rescale"):
        FillSettings(split=1, tail=20, key_rescale=-3).validate(4)


@pytest.mark.parametrize("selected", [[], [3, 7], [10, 11], [11]])
def test_gdn_rows_interleave_in_sequence_order(selected):
    """The sequence a GDN layer sweeps holds exact and filled rows in position order, both
    when the exact rows are only the tail (concatenation) and when selected prefix rows sit
    among the filled ones (scatter)."""
    from services.prefill.ridgefill import _interleave
    n, p = 16, 12
    exact = torch.tensor(selected + list(range(p, n)))
    filled = torch.tensor([i for i in range(p) if i not in selected])
    order = torch.argsort(torch.cat([exact, filled]))
    dest = torch.empty_like(order)
    dest[order] = torch.arange(n)
    rows = torch.arange(n, dtype=torch.float32)[:, None] * torch.ones(1, 3)
    out = _interleave(rows[exact], rows[filled], exact, filled, dest)
    assert torch.equal(out, rows)
