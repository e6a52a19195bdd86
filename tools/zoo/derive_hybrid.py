"""`smollm2-hybrid`: a Qwen3.5 text checkpoint (Gated DeltaNet and full attention) from SmolLM2.

The layout is every fourth layer at `fa_phase` (Qwen3.5's 3 : 1), or an explicit `fa_layers`
set; the zoo's delta keeps 8 of 30 layers, SmolLM2's copy circuit among them.

The layout, weight conversion and calibrated init live in `hybrid_init`. Here:
1. distil layer-wise: every token mixer regresses the parent's mixer output (relative MSE) on
   the parent's own hidden states, so the 30 layers train in parallel from one teacher pass;
2. distil on logits: per-token KL(parent ‖ child) through the whole child; with
   `needle_frac` > 0 that share of the batches are retrieval items (`derive.needle_batch`)
   whose answer-token KL is added, so the child learns the parent's copying;
3. store what the parent cannot regenerate (`encode_delta`): LoRA factors (fp16) on the
   GDN in_proj_qkv / out_proj, in_proj_z as int8 with per-row scales, the attention q/k
   projections (ballast rows refitted, gate rows trained) in fp16, the small tensors in fp32;
   `apply_hybrid` rebuilds the checkpoint from the parent and the delta; the layout
   (`fa_phase`, `fa_layers`) is read from the recipe in the delta's metadata.

Trainable: everything the conversion created or changed (GDN tensors, attention q/k
projections and norms); embeddings, MLPs, layer norms, v/o projections stay frozen.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.config import FULL_ATTENTION, ModelConfig
from models.loader import load_model, read_state_dict
from models.model import CausalLM
from models.zoo import DELTA_DIR
from tools.zoo.derive import LoraLinear, copy_batch, needle_batch
from tools.zoo.hybrid_init import (FA_PHASE, attention_logprobs, base_state, calibrate,
                                    hybrid_config, mixer, train_logits)

DELTA = DELTA_DIR / "smollm2-hybrid.safetensors"
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "chat_template.jinja")
LEGACY_FA_PHASE = 3             # deltas written before the phase was recorded


def delta_recipe(delta_path: str | Path) -> dict:
    with safe_open(str(delta_path), "pt") as f:
        return json.loads((f.metadata() or {}).get("recipe", "{}"))


def build_child(cfg_dict: dict, state: dict[str, torch.Tensor]) -> CausalLM:
    with torch.device("meta"):
        child = CausalLM(ModelConfig.from_hf(cfg_dict))
    child.load_state_dict(state, assign=True, strict=True)
    child.rotary.inv_freq = child.rotary.inv_freq.to("cpu")
    return child.eval()


def attach_trainables(child: CausalLM, rank: int, seed: int) -> list:
    """Freeze the child, then open what the conversion made: LoRA on the GDN projections
    taken from the parent, every other GDN tensor, and the attention q/k projections and
    norms."""
    child.requires_grad_(False)
    params = []
    for l, layer in enumerate(child.model.layers):
        if layer.kind == FULL_ATTENTION:
            a = layer.self_attn
            params += [p.requires_grad_(True) for p in (a.q_proj.weight, a.k_proj.weight,
                                                         a.q_norm.weight, a.k_norm.weight)]
            continue
        g = layer.linear_attn
        for i, name in enumerate(("in_proj_qkv", "out_proj")):
            lora = LoraLinear(getattr(g, name), rank, seed + 2 * l + i)
            setattr(g, name, lora)
            params += [lora.A, lora.B]
        params += [p.requires_grad_(True) for p in (
            g.in_proj_z.weight, g.in_proj_a.weight, g.in_proj_b.weight, g.conv1d.weight,
            g.A_log, g.dt_bias, g.norm.weight)]
    return params


def encode_delta(child: CausalLM) -> dict[str, torch.Tensor]:
    delta = {}
    for name, module in child.named_modules():
        if isinstance(module, LoraLinear):
            delta[name + ".lora_A"] = module.A.detach().half()
            delta[name + ".lora_B"] = module.B.detach().half()
    for name, p in child.named_parameters():
        if not p.requires_grad or name.endswith((".A", ".B")):
            continue
        p = p.detach()
        if name.endswith("in_proj_z.weight"):                   # int8, per-row scales
            scale = p.abs().amax(1).clamp_min(1e-12) / 127.0
            delta[name + ".q8"] = (p / scale[:, None]).round().to(torch.int8)
            delta[name + ".scale"] = scale
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            delta[name] = p.half()
        else:
            delta[name] = p.clone()
    return delta


def decode_delta(delta: dict[str, torch.Tensor]):
    """-> (tensors stored whole, {module name: (lora_A, lora_B)}): the inverse of
    `encode_delta`, with int8 rows dequantized."""
    plain, lora = {}, {}
    for key, value in delta.items():
        if key.endswith(".lora_A"):
            name = key[: -len(".lora_A")]
            lora[name] = (value, delta[name + ".lora_B"])
        elif key.endswith(".q8"):
            plain[key[:-3]] = value.float() * delta[key[:-3] + ".scale"][:, None]
        elif not key.endswith((".lora_B", ".scale")):
            plain[key] = value.float()
    return plain, lora


def apply_hybrid(parent_dir: str | Path, out_dir: str | Path,
                 delta_path: str | Path | None = None) -> Path:
    """Rebuild the full smollm2-hybrid checkpoint from the parent and the stored delta."""
    parent_dir, out_dir = Path(parent_dir), Path(out_dir)
    delta_path = delta_path or DELTA
    recipe = delta_recipe(delta_path)
    cfg_dict = hybrid_config(parent_dir, recipe.get("fa_phase", LEGACY_FA_PHASE),
                             recipe.get("fa_layers"))
    if recipe.get("layer_types", cfg_dict["layer_types"]) != cfg_dict["layer_types"]:
        raise ValueError(f"{delta_path}: recorded layer_types {recipe['layer_types']} do not "
                         f"match fa_phase {recipe.get('fa_phase', LEGACY_FA_PHASE)} / "
                         f"fa_layers {recipe.get('fa_layers')}")
    plain, lora = decode_delta(load_file(str(delta_path)))
    state = base_state(read_state_dict(parent_dir, torch.float32),
                       ModelConfig.from_hf(cfg_dict))
    state.update(plain)
    for name, (a, b) in lora.items():
        # fp64 product: the merged weights do not depend on the BLAS's thread count
        state[name + ".weight"] = state[name + ".weight"] + (b.double() @ a.double()).float()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sorted(state.items())},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    for name in _COPIED:
        if (parent_dir / name).exists():
            shutil.copy(parent_dir / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def kl_div(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) over the last axis, from log-probabilities."""
    return (teacher.exp() * (teacher - student)).sum(-1)


@torch.no_grad()
def heldout(parent: CausalLM, child: CausalLM, windows: list[torch.Tensor]) -> dict:
    """Per-token loss of both models and KL(parent ‖ child) on held-out windows."""
    lp = lc = kl = 0.0
    for ids in windows:
        tp = torch.log_softmax(parent.forward(ids)[0], -1)
        tc = torch.log_softmax(child.forward(ids)[0], -1)
        lp += F.nll_loss(tp[:-1], ids[0, 1:]).item()
        lc += F.nll_loss(tc[:-1], ids[0, 1:]).item()
        kl += kl_div(tp, tc).mean().item()
    n = len(windows)
    return {"parent_loss": lp / n, "child_loss": lc / n, "kl": kl / n}


def heldout_windows(tok, n: int = 4, seq_len: int = 512) -> list[torch.Tensor]:
    from evals.corpus import documents

    out = []
    for doc in documents("eval"):
        ids = tok(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= seq_len:
            out.append(torch.tensor([ids[:seq_len]]))
        if len(out) == n:
            break
    return out


KL_CHUNK = 512      # positions per logit chunk under gradient checkpointing


def distil_kl(parent: CausalLM, child: CausalLM, ids: torch.Tensor,
              checkpoint: bool = False,
              attn_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-position KL(parent || child) of the next-token distributions [T], attention
    transfer [len(attn_layers)]), both differentiable in the child.

    With `checkpoint`, the child's layers are checkpointed and the logits (T × vocabulary,
    the largest activation at long sequences) are formed and freed one chunk of `KL_CHUNK`
    positions at a time, in the backward pass too: the same values.

    Attention transfer: for each layer in `attn_layers` (full attention in the child), the
    KL from the parent's attention distribution to the child's, per head and query
    position, averaged. It asks the attention the child kept to look where the parent's
    looks, on the child's own residual stream, whatever the text: the copying heads'
    mechanism rather than any task's answers. The forward keeps only each layer's q and k;
    the T × T maps are formed one layer at a time and again in the backward pass
    (`attention_kl`), so their memory is one layer's whatever the number of layers."""
    qk_t = dict.fromkeys(attn_layers)
    qk_s = dict.fromkeys(attn_layers)
    with torch.no_grad():
        hidden_t = train_logits(parent, ids, final=False, attn=qk_t)[0]
    hidden_s = train_logits(child, ids, checkpoint=checkpoint, final=False, attn=qk_s)[0]
    missing = [l for l in attn_layers if qk_s[l] is None]
    if missing:
        raise ValueError(f"attention transfer: layers {missing} are not full attention "
                         "in the child")
    transfer = torch.stack([torch.utils.checkpoint.checkpoint(
        attention_kl, *qk_t[l], *qk_s[l], use_reentrant=False)
        for l in attn_layers]) if attn_layers else torch.zeros(0)

    def kl(hs: torch.Tensor, ht: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher = torch.log_softmax(parent.final(ht), -1)
        return kl_div(teacher, torch.log_softmax(child.final(hs), -1))

    if not checkpoint:
        return kl(hidden_s, hidden_t), transfer
    return torch.cat([torch.utils.checkpoint.checkpoint(kl, hidden_s[i:i + KL_CHUNK],
                                                        hidden_t[i:i + KL_CHUNK],
                                                        use_reentrant=False)
                      for i in range(0, hidden_s.shape[0], KL_CHUNK)]), transfer


def attention_kl(q_t: torch.Tensor, k_t: torch.Tensor, q_s: torch.Tensor,
                 k_s: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) of one layer's attention distributions from their q and k
    (`attention_logprobs`), averaged over heads and query positions."""
    with torch.no_grad():
        teacher = attention_logprobs(q_t, k_t)
    return kl_div(teacher, attention_logprobs(q_s, k_s)).mean()


def _schedule(opt, lr: float, step: int, steps: int, warmup: int = 10):
    for group in opt.param_groups:
        group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))


def derive_hybrid(parent_dir: str | Path, out_dir: str | Path, *, layerwise_steps: int = 60,
                  steps: int = 120, seq_len: int = 512, rank: int = 48,
                  lr: float = 3e-3, kl_lr: float = 5e-4, seed: int = 0,
                  fa_phase: int = FA_PHASE, fa_layers: list[int] | None = None,
                  needle_frac: float = 0.0, needle_len: int | None = None,
                  answer_weight: float = 1.0, repeated_share: float = 0.0,
                  needle_formats: str = "classic", init_delta: str | Path | None = None,
                  gradient_checkpointing: bool = False, attn_weight: float = 0.0,
                  attn_layers: list[int] | None = None, copy_frac: float = 0.0,
                  delta_path: str | Path = DELTA, log=print) -> dict:
    """Calibrate, distil layer-wise then on logits; writes the delta and the checkpoint.

    `init_delta`: continue from a stored delta instead (its layout; no calibration, no
    layer-wise stage): only the logit stage runs, e.g. with retrieval items
    (`needle_frac`, `needle_len` tokens each, answer-token KL weighted by `answer_weight`,
    in the train family's `needle_formats`: `derive.needle_batch`).
    The recipe records the one it continued from. `gradient_checkpointing` makes the logit
    stage's memory fit long items (`distil_kl`) at about one more forward pass per step.
    `attn_weight` > 0 adds attention transfer (`distil_kl`) on `attn_layers` (default:
    every full-attention layer of the child) to each logit-stage step. `copy_frac` of the
    logit-stage batches are copying items with no task format (`derive.copy_batch`,
    `needle_len` tokens), whose copied-span KL is weighted like an answer's."""
    import random

    from evals.corpus import documents, haystack_text
    from services.common.tokenizer import load_tokenizer

    if needle_frac + copy_frac > 1:     # refused before minutes of loading and calibration
        raise ValueError(f"needle_frac + copy_frac is {needle_frac + copy_frac}: over 1")
    torch.manual_seed(seed)
    parent_dir, out_dir = Path(parent_dir), Path(out_dir)
    parent = load_model(parent_dir)
    tok = load_tokenizer(parent_dir)
    ids = torch.tensor(tok("\n\n".join(d.text for d in documents("calib")),
                           add_special_tokens=False)["input_ids"])
    n_windows = len(ids) // seq_len
    windows = ids[: n_windows * seq_len].view(n_windows, seq_len)
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))
    batch = lambda i: windows[order[4 + i % (n_windows - 4)]][None]
    start = time.perf_counter()
    parent_recipe = None
    if init_delta is not None:
        parent_recipe = delta_recipe(init_delta)
        fa_phase = parent_recipe.get("fa_phase", LEGACY_FA_PHASE)
        fa_layers = parent_recipe.get("fa_layers")
        layerwise_steps = 0
    cfg_dict = hybrid_config(parent_dir, fa_phase, fa_layers)
    cfg = ModelConfig.from_hf(cfg_dict)
    base = base_state(read_state_dict(parent_dir, torch.float32), cfg)
    if init_delta is None:
        base.update(calibrate(parent, cfg, [windows[order[i]][None] for i in range(4)]))
        lora = {}
    else:
        plain, lora = decode_delta(load_file(str(init_delta)))
        base.update(plain)
        rank = next(iter(lora.values()))[0].shape[0]
    child = build_child(cfg_dict, base)
    if attn_weight > 0:
        fa = [l for l, layer in enumerate(child.model.layers) if layer.kind == FULL_ATTENTION]
        attn_layers = sorted(set(attn_layers)) if attn_layers else fa
        if not set(attn_layers) <= set(fa):
            raise ValueError(f"attention transfer on layers {attn_layers}: the child's full-"
                             f"attention layers are {fa}")
        if gradient_checkpointing:
            raise ValueError("attention transfer reads q and k inside the layers: use it "
                             "without gradient checkpointing")
    else:
        attn_layers = []
    params = attach_trainables(child, rank, seed)
    with torch.no_grad():
        for name, module in child.named_modules():
            if name in lora:
                module.A.copy_(lora[name][0].float())
                module.B.copy_(lora[name][1].float())
    log(f"[hybrid] {'loaded ' + str(init_delta) if init_delta else 'calibrated'}; "
        f"{sum(p.numel() for p in params) / 1e6:.1f} M trainable "
        f"({time.perf_counter() - start:.0f}s)")
    pos = torch.arange(seq_len)[None]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    layer_err = []
    for step in range(layerwise_steps):
        trace = []
        with torch.no_grad():
            train_logits(parent, batch(step), trace)
        errs = [(mixer(child, l, x, pos) - m).pow(2).mean() / m.pow(2).mean()
                for l, (x, m) in enumerate(trace)]
        loss = torch.stack(errs).mean()
        opt.zero_grad()
        loss.backward()
        _schedule(opt, lr, step, layerwise_steps)
        opt.step()
        layer_err.append(loss.item())
        if step % 10 == 0 or step == layerwise_steps - 1:
            log(f"[hybrid] layer-wise {step}: rel. MSE {loss.item():.4f} "
                f"({time.perf_counter() - start:.0f}s)")
    t_layerwise = time.perf_counter() - start
    opt = torch.optim.AdamW(params, lr=kl_lr, weight_decay=0.0)
    rng = random.Random(seed)
    filler = tok(haystack_text(documents("calib")), add_special_tokens=False)["input_ids"]
    kls, answer_kl, attn_kl, copy_kl = [], [], [], []
    for step in range(steps):
        b, answer, draw = batch(layerwise_steps + step), None, rng.random()
        if draw < needle_frac:
            b, answer = needle_batch(tok, filler, needle_len or seq_len, rng, repeated_share,
                                     needle_formats)
        elif draw < needle_frac + copy_frac:
            b, answer = copy_batch(tok, filler, needle_len or seq_len, rng)
        kl, transfer = distil_kl(parent, child, b, gradient_checkpointing,
                                 tuple(attn_layers))                             # [T], [A]
        loss = kl.mean()
        if attn_layers:
            loss = loss + attn_weight * transfer.mean()
            attn_kl.append(transfer.mean().item())
        if answer is not None:
            loss = loss + answer_weight * kl[answer].mean()
            (answer_kl if draw < needle_frac else copy_kl).append(kl[answer].mean().item())
        opt.zero_grad()
        loss.backward()
        _schedule(opt, kl_lr, step, steps, warmup=5)
        opt.step()
        kls.append(loss.item())
        if step % 5 == 0 or step == steps - 1:
            recent = answer_kl[-5:]
            log(f"[hybrid] KL {step}: {loss.item():.4f}"
                + (f", answer KL (last 5 items) {sum(recent) / len(recent):.3f}" if recent else "")
                + (f", attention KL {attn_kl[-1]:.3f}" if attn_kl else "")
                + (f", copy KL (last 5) {sum(copy_kl[-5:]) / len(copy_kl[-5:]):.3f}"
                   if copy_kl else "")
                + f" ({time.perf_counter() - start:.0f}s)")
    seconds = round(time.perf_counter() - start)
    recipe = {"name": "smollm2-hybrid", "parent": "smollm2-135m",
              "fa_phase": fa_phase, "fa_layers": fa_layers,
              "layer_types": cfg_dict["layer_types"],
              "layerwise_steps": layerwise_steps, "steps": steps, "seq_len": seq_len,
              "rank": rank, "lr": lr, "kl_lr": kl_lr, "seed": seed, "needle_frac": needle_frac,
              "needle_len": needle_len or seq_len, "answer_weight": answer_weight,
              "repeated_share": repeated_share, "needle_formats": needle_formats,
              "gradient_checkpointing": gradient_checkpointing,
              "attn_weight": attn_weight, "attn_layers": attn_layers,
              "copy_frac": copy_frac,
              "copy_kl_last10": (sum(copy_kl[-10:]) / len(copy_kl[-10:])
                                 if copy_kl else None),
              "attn_kl_first": attn_kl[0] if attn_kl else None,
              "attn_kl_last10": (sum(attn_kl[-10:]) / len(attn_kl[-10:])
                                 if attn_kl else None),
              "continued_from": parent_recipe,
              "answer_kl_last10": (sum(answer_kl[-10:]) / len(answer_kl[-10:])
                                   if answer_kl else None),
              "data": "python-stdlib-docstrings (calib split)",
              "layerwise_first": layer_err[0] if layer_err else None,
              "layerwise_last10": sum(layer_err[-10:]) / max(1, len(layer_err[-10:])),
              "kl_first": kls[0] if kls else None,
              "kl_last10": sum(kls[-10:]) / max(1, len(kls[-10:])),
              "seconds_layerwise": round(t_layerwise), "seconds": seconds}
    Path(delta_path).parent.mkdir(parents=True, exist_ok=True)
    save_file(encode_delta(child), str(delta_path), metadata={"recipe": json.dumps(recipe)})
    apply_hybrid(parent_dir, out_dir, delta_path)
    recipe["heldout"] = heldout(parent, load_model(out_dir), heldout_windows(tok))
    recipe["delta_mb"] = round(Path(delta_path).stat().st_size / 2 ** 20, 1)
    log(f"[hybrid] held-out {recipe['heldout']}, delta {recipe['delta_mb']} MB")
    return recipe
