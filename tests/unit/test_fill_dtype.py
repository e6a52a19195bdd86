"""The fill's precision: filled rows' map, norm and projections in bf16, exact rows untouched."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from evals.catalog import make_arm
from evals.run import SAME_ARM, _references
from models.config import FULL_ATTENTION
from services.prefill.fill_layers import (FILLED_ATTN_MODULES, FILLED_GDN_MODULES, FillLayers,
                                           parse_fill_dtype)
from services.prefill.maps import RidgeMaps
from services.prefill.ridgefill import RidgeFill
from services.prefill.service import PrefillConfig, PrefillService
from services.prefill.settings import FillError, FillSettings


def _ids(n: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(7)).tolist()


def _fill(model, maps_dir, dtype):
    layers = FillLayers(model, dtype)
    return RidgeFill(model, RidgeMaps(maps_dir, model, 1, dtype=layers.dtype),
                     fill_layers=layers)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_5"])
def test_bf16_fill_rounds_only_the_filled_rows(four_layer, family):
    """Filled rows' K/V (or GDN state) in bf16 sit within bf16 rounding of the fp32 fill; the
    exact rows' own computation is unchanged, so with nothing filled the two agree bitwise."""
    model, maps_dir = four_layer(family)
    s = FillSettings(split=1, tail=12)
    ids = _ids(70)
    ref = _fill(model, maps_dir, None).prefill(ids, s)
    got = _fill(model, maps_dir, torch.bfloat16).prefill(ids, s)
    assert got.num_filled == ref.num_filled == 58
    for l in ref.k:
        assert got.k[l].dtype == model.dtype
        if l >= s.split:   # filled rows of upper layers: rounded, not computed otherwise
            f = slice(0, 58)
            assert not torch.equal(got.k[l][f], ref.k[l][f])
            err = (got.k[l][f] - ref.k[l][f]).norm() / ref.k[l][f].norm()
            assert err < 2e-2
        else:
            assert torch.equal(got.k[l], ref.k[l])              # below the split: exact
    for l in ref.recurrent:
        err = (got.recurrent[l] - ref.recurrent[l]).norm() / ref.recurrent[l].norm()
        assert (0 < err < 3e-2) if l >= s.split else err == 0
    assert (got.logits - ref.logits).abs().max() < 5e-2 * ref.logits.abs().max()
    # every prefix row selected: nothing is filled, the bf16 copies are never used
    all_rows = FillSettings(split=1, tail=12, selector="random", budget=1.0)
    a = _fill(model, maps_dir, None).prefill(ids, all_rows)
    b = _fill(model, maps_dir, torch.bfloat16).prefill(ids, all_rows)
    assert a.num_filled == b.num_filled == 0
    assert torch.equal(a.logits, b.logits)


def test_bf16_maps_are_the_stored_tensors(four_layer):
    """Maps for a bf16 fill are the file's bf16 matrices as stored (no fp32 round trip), and
    the filled keys come from them: the bf16 fill's keys differ from a fill that applies the
    same maps in fp32 by bf16 rounding only."""
    model, maps_dir = four_layer("llama3")
    stored = load_file(str(maps_dir / "maps-S1.safetensors"))
    maps = RidgeMaps(maps_dir, model, 1, dtype=torch.bfloat16)
    for l in maps.layers:
        a, b = maps.get(l)
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, stored[f"A.{l}"])
    streamed = RidgeMaps(maps_dir, model, 1, dtype=torch.bfloat16, resident=False)
    assert torch.equal(streamed.get(3)[0], maps.get(3)[0]) and streamed.resident_bytes == 0
    assert maps.resident_bytes * 2 == RidgeMaps(maps_dir, model, 1).resident_bytes


def test_service_fill_dtype_flag_and_disabled_fill_is_still_exact(four_layer):
    model, maps_dir = four_layer("qwen3_5")
    with pytest.raises(FillError, match="fill dtype"):
        PrefillConfig(fill_dtype="fp8")
    with pytest.raises(ValueError, match="fill dtype"):
        parse_fill_dtype("half")
    low = PrefillService(model, PrefillConfig(mode="ridgefill", maps_dir=str(maps_dir), split=1,
                                              tail=8, fill_dtype="bfloat16"))
    plain = PrefillService(model, PrefillConfig(mode="ridgefill", maps_dir=str(maps_dir),
                                                split=1, tail=8))
    assert low.maps(1).get(2)[0].dtype == torch.bfloat16
    assert plain.maps(1).get(2)[0].dtype == model.dtype
    ids = _ids(40)
    off = FillSettings(split=4, tail=8)                       # S = L: the fill is disabled
    a, b = low.prefill(ids, off), plain.prefill(ids, off)
    assert torch.equal(a.logits, b.logits)
    for l in a.recurrent:
        assert torch.equal(a.recurrent[l], b.recurrent[l])
    assert low.fill_layers.copy_bytes == 0                   # nothing filled, nothing copied
    on = low.prefill(ids, FillSettings(split=1, tail=8))
    assert on.num_filled == 32 and low.fill_layers.copy_bytes > 0
    # the copies hold only what a filled row runs in the upper layers, in bf16: the input
    # norm and the K/V (or GDN state-input) projections, never the query/output/gate ones
    copied, kept, mixers = sorted(low.fill_layers._copies), 0, 0
    assert copied and min(copied) >= 1
    for l in copied:
        layer = model.layer(l)
        names = FILLED_ATTN_MODULES if layer.kind == FULL_ATTENTION else FILLED_GDN_MODULES
        block = layer.self_attn if layer.kind == FULL_ATTENTION else layer.linear_attn
        mods = [layer.input_layernorm] + [m for n, m in block.named_children() if n in names]
        kept += sum(p.numel() * 2 for m in mods for p in m.parameters())
        norm, part = low.fill_layers._layer(l)
        for unused in ("q_proj", "o_proj", "in_proj_z", "out_proj", "norm", "conv1d"):
            assert getattr(part, unused, None) is None
        assert list(part.parameters(recurse=False)) == []
        mixers += sum(p.numel() * 2 for m in (layer.input_layernorm, block) for p in m.parameters())
    assert low.fill_layers.copy_bytes == kept
    assert kept < 0.7 * mixers                         # smaller than whole mixers
    # the model's own modules stay whole
    assert all(model.layer(l).self_attn.o_proj is not None for l in copied
               if model.layer(l).kind == FULL_ATTENTION)


def test_eval_arm_suffix_runs_the_arm_in_bf16_and_pairs_it_with_itself(four_layer):
    model, maps_dir = four_layer("llama3")
    arm = make_arm("ridgefill@bfloat16", model, maps_dir=maps_dir, split=1, tail=10)
    assert arm.name == "ridgefill@bfloat16" and arm.fill.fill_layers.lowered
    assert arm.fill.maps.get(3)[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="RidgeFill-family"):
        make_arm("exact@bfloat16", model)
    with pytest.raises(ValueError, match="RidgeFill-family"):
        make_arm("ridgefill@float16", model, maps_dir=maps_dir, split=1)
    results = {"exact": 0, "identity": 0, "ridgefill": 0, "ridgefill@bfloat16": 0,
               "ridgefill+probe@bfloat16": 0, "identity+probe@bfloat16": 0}
    assert (SAME_ARM, "ridgefill") in _references("ridgefill@bfloat16", results)
    refs = _references("ridgefill+probe@bfloat16", results)
    assert ("paired_vs_identity_same_selector", "identity+probe@bfloat16") in refs
    assert all(key != SAME_ARM for key, _ in refs)           # no model-dtype twin in the run


def test_serve_flag_reaches_the_prefill_config():
    from services.cli import build_parser
    from services.cli.serve_args import ServeArgs

    args = build_parser().parse_args(["serve", "--model", "m", "--fill-dtype", "bfloat16"])
    assert ServeArgs.from_cli(args).engine_options().prefill.fill_dtype == "bfloat16"
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert ServeArgs.from_cli(args).engine_options().prefill.fill_dtype == "model"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--fill-dtype", "float16"])
