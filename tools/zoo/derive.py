"""Derived checkpoints built from SmolLM2 by the project's own tools (`splitstack derive`).

`smollm2-qknorm` (Qwen3 family): per-head RMSNorm inserted on q and k of every layer.
  1. calibrate (`calibrate_qk`, the ballast pair of `hybrid_init.fit_ballast_qk`): per layer
     the rotary pair with the least q·k energy is given up; its q/k rows are refitted so every
     head's q and k have a near-constant norm, its q_norm weight is zero (and stays zero in
     training), and the other norm weights are the least-squares w_d = Σ q_d n_d / Σ n_d²
     with n = q / rms(q). Plain least-squares norms without the ballast pair move the
     attention mass off the sink token (its key is about half the typical norm);
  2. recover: distil against the parent's logits (KL), training only the norm weights and
     rank-r LoRA factors on q_proj / k_proj; everything else stays frozen;
  3. store the delta in `models/zoo/deltas/`: norm weights, LoRA factors and the ballast rows
     of q_proj / k_proj with their row indices, all fp32; `apply_qknorm` rebuilds the full
     checkpoint from the parent and the delta.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from models.config import ModelConfig
from models.loader import load_model, read_state_dict
from models.model import CausalLM
from models.zoo import DELTA_DIR
from tools.zoo.hybrid_init import fit_ballast_qk

DELTA = DELTA_DIR / "smollm2-qknorm.safetensors"


class LoraLinear(nn.Module):
    """y = x Wᵀ + (x Aᵀ) Bᵀ with W frozen; B starts at zero so training starts at W."""

    def __init__(self, base: nn.Linear, rank: int, seed: int):
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(torch.randn(rank, base.in_features, generator=gen)
                              / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return F.linear(x, self.base.weight) + F.linear(F.linear(x, self.A), self.B)

    def merged(self) -> torch.Tensor:
        return self.base.weight + self.B @ self.A


def train_logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Differentiable forward of a dense model (SDPA for the sweep), built from the stages."""
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    x = model.embed(ids)
    for l in range(model.config.num_hidden_layers):
        a = model.attn_inputs(l, x, pos)
        o = F.scaled_dot_product_attention(a.q.transpose(1, 2), a.k.transpose(1, 2),
                                           a.v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True).transpose(1, 2)
        x = model.mlp(l, model.attn_output(l, x, o, a.gate))
    return model.final(x)


def qknorm_config(parent_dir: Path) -> dict:
    cfg = json.loads((parent_dir / "config.json").read_text())
    if cfg["model_type"] != "llama":
        raise ValueError(f"qknorm derivation starts from a llama checkpoint, got "
                         f"{cfg['model_type']!r}")
    cfg = dict(cfg, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    for key in ("mlp_bias", "pretraining_tp"):
        cfg.pop(key, None)
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg


def build_child(parent_dir: Path, norms: dict[str, torch.Tensor]) -> tuple[CausalLM, dict]:
    cfg_dict = qknorm_config(parent_dir)
    state = read_state_dict(parent_dir, torch.float32)
    if cfg_dict.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    state.update(norms)
    with torch.device("meta"):
        child = CausalLM(ModelConfig.from_hf(cfg_dict))
    child.load_state_dict(state, assign=True, strict=True)
    child.rotary.inv_freq = child.rotary.inv_freq.to("cpu")
    return child.eval(), cfg_dict


def ballast_rows(dims: list[int], heads: int, head_dim: int) -> torch.Tensor:
    """Row indices of the ballast dims in every head of a [heads·D, h] projection."""
    return (torch.arange(heads)[:, None] * head_dim + torch.tensor(dims)[None]).flatten()


@torch.no_grad()
def calibrate_qk(parent: CausalLM, batches: list[torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Ballast-pair init of every layer: the child's q/k projections and norm weights, and
    each layer's ballast dims [p, p + D/2]."""
    cfg = parent.config
    xns = [[] for _ in range(cfg.num_hidden_layers)]
    for ids in batches:
        x = parent.embed(ids)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        for l in range(cfg.num_hidden_layers):
            xns[l].append(parent.norm_in(l, x).flatten(0, 1))                # [B·T, h]
            a = parent.attn_inputs(l, x, pos)
            o = F.scaled_dot_product_attention(a.q.transpose(1, 2), a.k.transpose(1, 2),
                                               a.v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
            x = parent.mlp(l, parent.attn_output(l, x, o, a.gate))
    state, pairs = {}, []
    for l in range(cfg.num_hidden_layers):
        attn, p = parent.layer(l).self_attn, f"model.layers.{l}.self_attn."
        wq, wk, q_norm, k_norm, dims = fit_ballast_qk(attn.q_proj.weight, attn.k_proj.weight,
                                                      torch.cat(xns[l]), cfg)
        state.update({p + "q_proj.weight": wq, p + "k_proj.weight": wk,
                      p + "q_norm.weight": q_norm, p + "k_norm.weight": k_norm})
        pairs.append(dims)
    return state, pairs


def repeated_passage(tok, filler: list[int], rng, length: int) -> list[int]:
    """A haystack of one short passage of `filler` (2 to 4 of its sentences, at most 80
    tokens) said over and over, `length` tokens or more: text whose next token is easy to
    guess from the text just before, so the item rewards copying from the needle over
    continuing the repetition."""
    start = rng.randrange(0, max(1, len(filler) - 400))
    text = " ".join(tok.decode(filler[start:start + 400]).split())
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text)[1:-1] if len(s.split()) >= 3]
    k = min(len(sentences), rng.randint(2, 4))
    i = rng.randrange(0, len(sentences) - k + 1) if sentences else 0
    passage = tok(" " + " ".join(sentences[i:i + k] or [text]),
                  add_special_tokens=False)["input_ids"][:80]
    return passage * (length // len(passage) + 1)


NEEDLE_FORMATS = ("classic", "varied")


def needle_batch(tok, filler: list[int], seq_len: int, rng, repeated_share: float = 0.0,
                 formats: str = "classic") -> tuple[torch.Tensor, torch.Tensor]:
    """A retrieval item from calibration text with its answer appended, and a mask of the
    answer positions (where the parent's copying behaviour must be kept). With
    `repeated_share`, that share of the items hide the needle in one calibration passage
    repeated (`repeated_passage`) instead of running text.

    `formats`: "classic" draws single, multikey and word items whose needles state the value
    twice; "varied" adds `code` values (serial codes of 6-40 characters) and states the
    value once in half the items, in the train family's other wordings."""
    from evals.tasks import make_item

    if formats not in NEEDLE_FORMATS:
        raise ValueError(f"formats must be one of {NEEDLE_FORMATS}, got {formats!r}")
    varied = formats == "varied"
    task = rng.choice(["single", "multikey", "word"] + (["code"] if varied else []))
    once = varied and rng.random() < 0.5
    answer_len = 32 if varied else 8
    if repeated_share and rng.random() < repeated_share:
        filler = repeated_passage(tok, filler, rng, seq_len)
    item = make_item(task, tok, filler, seq_len - answer_len, rng.random(), rng,
                     rng.randrange(2), once=once)
    answer = tok(" " + item.answers[0] + ".", add_special_tokens=False)["input_ids"]
    ids = (item.prompt_ids + answer)[:seq_len]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(item.prompt_ids) - 1:len(item.prompt_ids) - 1 + len(answer)] = True
    return torch.tensor([ids]), mask[:len(ids)]


COPY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


def copy_batch(tok, filler: list[int], seq_len: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """A copying item with no task format: calibration text with one random span written
    into it twice, the first time in the first half, the second just before the end, and a
    mask of the second copy's positions after its first token (where the parent predicts
    the span from the first copy: its induction circuit at work). No question, key or answer
    template; the span is 8-48 random word pieces, or half the time 12-48 single letters and
    digits (the train family's serial-code alphabet), the case where one token of context
    is not enough to find the place to copy from."""
    if rng.random() < 0.5:
        lo = min(1000, len(tok) // 10)
        span = [rng.randrange(lo, min(40000, len(tok))) for _ in range(rng.randint(8, 48))]
    else:
        chars = [tok.convert_tokens_to_ids(c) for c in COPY_CHARS]
        span = [rng.choice(chars) for _ in range(rng.randint(12, 48))]
    room = seq_len - 2 * len(span)
    if room < 16:
        raise ValueError(f"seq_len {seq_len} leaves no text around a {len(span)}-token span")
    start = rng.randrange(len(filler) - room)
    text = filler[start:start + room]
    first = rng.randrange(0, room // 2)
    second = room - rng.randint(0, 8)
    ids = text[:first] + span + text[first:second] + span + text[second:]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    at = first + len(span) + (second - first)          # the second copy's first position
    mask[at:at + len(span) - 1] = True                 # predicting tokens 2.. of the copy
    return torch.tensor([ids]), mask


def derive_qknorm(parent_dir: str | Path, out_dir: str | Path, *, steps: int = 120,
                  seq_len: int = 384, rank: int = 16, lr: float = 2e-3, seed: int = 0,
                  needle_frac: float = 0.0, delta_path: str | Path = DELTA,
                  log=print) -> dict:
    """Calibrate + distil; writes the delta and the full checkpoint. Returns the recipe.
    `steps=0` gives the calibration-only checkpoint.

    With `needle_frac` > 0, that share of the batches are retrieval items built from the
    calibration split with the answer appended; the KL on the answer tokens is added to
    the mean KL, so the copying the parent does at long range is distilled too."""
    import random

    from evals.corpus import haystack_text
    from evals.corpus import documents
    from services.common.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    parent_dir, out_dir = Path(parent_dir), Path(out_dir)
    parent = load_model(parent_dir)
    tok = load_tokenizer(parent_dir)
    text = "\n\n".join(d.text for d in documents("calib"))
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    n_windows = len(ids) // seq_len
    windows = ids[: n_windows * seq_len].view(n_windows, seq_len)
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    init, pairs = calibrate_qk(parent, [windows[order[i]][None] for i in range(4)])
    log(f"[derive] calibrated {len(pairs)} layers in {time.perf_counter() - start:.0f}s")
    child, cfg_dict = build_child(parent_dir, init)
    child.requires_grad_(False)
    trainable = []
    for l in range(child.config.num_hidden_layers):
        attn = child.layer(l).self_attn
        keep = torch.ones(child.config.head_dim)
        keep[pairs[l]] = 0.0                       # the ballast pair never enters q·k
        attn.q_norm.weight.requires_grad_(True)
        attn.q_norm.weight.register_hook(lambda g, keep=keep: g * keep)
        attn.k_norm.weight.requires_grad_(True)
        trainable += [attn.q_norm.weight, attn.k_norm.weight]
        attn.q_proj = LoraLinear(attn.q_proj, rank, seed + 2 * l)
        attn.k_proj = LoraLinear(attn.k_proj, rank, seed + 2 * l + 1)
        trainable += [attn.q_proj.A, attn.q_proj.B, attn.k_proj.A, attn.k_proj.B]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    filler = tok(haystack_text(documents("calib")), add_special_tokens=False)["input_ids"]
    losses = []
    for step in range(steps):
        answer_mask = None
        if rng.random() < needle_frac:
            batch, answer_mask = needle_batch(tok, filler, seq_len, rng)
        else:
            batch = windows[order[4 + step % (n_windows - 4)]][None]
        with torch.no_grad():
            teacher = torch.log_softmax(train_logits(parent, batch), -1)
        student = torch.log_softmax(train_logits(child, batch), -1)
        kl = (teacher.exp() * (teacher - student)).sum(-1)[0]              # [T]
        loss = kl.mean() + (kl[answer_mask].mean() if answer_mask is not None else 0.0)
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"[derive] step {step}: KL {loss.item():.4f} ({time.perf_counter() - start:.0f}s)")
    cfg = child.config
    delta = {}
    for l in range(cfg.num_hidden_layers):
        attn = child.layer(l).self_attn
        p = f"model.layers.{l}.self_attn"
        delta[f"{p}.q_norm.weight"] = attn.q_norm.weight.detach().clone()
        delta[f"{p}.k_norm.weight"] = attn.k_norm.weight.detach().clone()
        for name, heads in (("q_proj", cfg.num_attention_heads),
                            ("k_proj", cfg.num_key_value_heads)):
            lora = getattr(attn, name)
            rows = ballast_rows(pairs[l], heads, cfg.head_dim)
            delta[f"{p}.{name}.ballast_rows"] = rows
            delta[f"{p}.{name}.ballast"] = lora.base.weight.detach()[rows].clone()
            delta[f"{p}.{name}.lora_A"] = lora.A.detach().clone()
            delta[f"{p}.{name}.lora_B"] = lora.B.detach().clone()
    recipe = {"name": "smollm2-qknorm", "parent": "smollm2-135m", "init": "ballast pair",
              "steps": steps, "seq_len": seq_len, "rank": rank, "lr": lr, "seed": seed,
              "needle_frac": needle_frac,
              "data": "python-stdlib-docstrings (calib split)", "objective": "KL to parent",
              "kl_first": losses[0] if losses else None,
              "kl_last10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
              "seconds": round(time.perf_counter() - start)}
    Path(delta_path).parent.mkdir(parents=True, exist_ok=True)
    save_file(delta, str(delta_path), metadata={"recipe": json.dumps(recipe)})
    apply_qknorm(parent_dir, out_dir, delta_path)
    return recipe


def apply_qknorm(parent_dir: str | Path, out_dir: str | Path,
                 delta_path: str | Path | None = None) -> Path:
    """Rebuild the full smollm2-qknorm checkpoint from the parent and the stored delta:
    ballast rows first, then the LoRA merged in float64 so the rebuild does not depend on
    the thread count."""
    import shutil

    parent_dir, out_dir = Path(parent_dir), Path(out_dir)
    delta = load_file(str(delta_path or DELTA))
    state = read_state_dict(parent_dir, torch.float32)
    for key, value in delta.items():
        if key.endswith(".ballast"):
            base = key[: -len(".ballast")]
            state[base + ".weight"][delta[base + ".ballast_rows"]] = value
        elif not key.endswith((".ballast_rows", ".lora_A", ".lora_B")):
            state[key] = value
    for key, a in delta.items():
        if key.endswith(".lora_A"):
            base = key[: -len(".lora_A")] + ".weight"
            b = delta[key[:-1] + "B"]
            state[base] = (state[base].double() + b.double() @ a.double()).float()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(qknorm_config(parent_dir), indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        if (parent_dir / name).exists():
            shutil.copy(parent_dir / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
