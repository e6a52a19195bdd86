"""The decode fast paths change no math: RoPE in its roll form, the per-step cos/sin reuse,
and the row-count choice of CPU product in `models.layers.project`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.config import RopeConfig
from models.layers import PACK_MIN_ELEMENTS, _MKL, project
from models.rope import Rotary


def rotate_half_reference(x, positions, inv_freq, rotary_dim):
    """The textbook form: x·cos + [−x₂, x₁]·sin on the first `rotary_dim` channels."""
    emb = positions[..., None].float() * inv_freq
    emb = torch.cat([emb, emb], dim=-1)
    cos, sin = emb.cos()[..., None, :], emb.sin()[..., None, :]
    rot, half = x[..., :rotary_dim], rotary_dim // 2
    out = rot * cos + torch.cat([-rot[..., half:], rot[..., :half]], dim=-1) * sin
    return torch.cat([out, x[..., rotary_dim:]], dim=-1)


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_rope_roll_form_is_bitwise_the_rotate_half_form(rotary_dim):
    rotary = Rotary(RopeConfig(theta=1e5), 64, rotary_dim)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 5000, (3, 11), generator=g)
    x = torch.randn(3, 11, 4, 64, generator=g)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert torch.equal(rotary.apply(x, cos, sin),
                       rotate_half_reference(x, positions, rotary.inv_freq, rotary_dim))


def test_rope_reuses_a_lookup_only_for_equal_positions():
    rotary = Rotary(RopeConfig(theta=1e4), 64, 64)
    positions = torch.arange(5)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert rotary.cos_sin(torch.arange(5), torch.float32)[0] is cos        # equal: reused
    positions += 7                                                           # edited in place
    moved, _ = rotary.cos_sin(positions, torch.float32)
    assert moved is not cos
    assert torch.equal(moved, rotary.cos_sin(torch.arange(7, 12), torch.float32)[0])
    assert rotary.cos_sin(torch.arange(7, 12), torch.bfloat16)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 2, 8, 64, 65])
def test_project_matches_linear_at_every_row_count(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 48, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 48, generator=g)
    torch.testing.assert_close(project(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert project(x[None], w).shape == (1, rows, 96)


def test_packed_head_is_rebuilt_when_the_weight_changes_in_place():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(PACK_MIN_ELEMENTS // 64, 64, generator=g)      # 8 MB: takes the packed path
    x = torch.randn(1, 64, generator=g)
    torch.testing.assert_close(project(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert hasattr(w, "_splitstack_packed") == _MKL     # MKL builds (every x86 one) pack
    with torch.no_grad():
        w.mul_(-2.0)                                                   # a stale copy would miss this
    torch.testing.assert_close(project(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    w.requires_grad_(True)                                             # autograd: plain F.linear
    project(x, w).sum().backward()
    assert w.grad is not None
