"""`splitstack convert-qfirst`: move a trained checkpoint to the q-first read point (seed 003, §6).

Under q-first wiring layer l's query reads u_{l-1}, the input of layer l-1's feed-forward,
instead of x_l; its key and value do not move, and layer 0 is exempt (its attention reads
the embedding under either wiring). The conversion:

1. rewire (`splitstack_wiring: qfirst` in config.json) and fine-tune `Wq` of every
   full-attention layer l ≥ 1 with the next-token loss on training text; everything else,
   the tied embedding and so the readout included, stays frozen;
2. give the unconverted checkpoint the same fine-tune (same repair set, schedule, data
   order and seed), because the fine-tune also adapts both to the corpus, and report
   d = bpb(converted + SFT) − bpb(unconverted + the same SFT) on held-out text, beside
   the untrained displacement bpb(rewired) − bpb(unconverted);
3. save the converted checkpoint: the source's tensors under their own names and dtypes,
   only the repaired `q_proj` weights replaced, and a config that records the wiring.

Bits per byte = summed next-token NLL (nats) / ln 2 / UTF-8 bytes of the scored text.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import FULL_ATTENTION
from models.loader import load_model, normalize_name, safetensors_files
from models.model import CausalLM
from tools.zoo.hybrid_init import train_logits

RESULT_FILE = "qfirst_conversion.json"


class ConversionError(ValueError):
    """A checkpoint or data set the conversion cannot use; carries the offending value."""


@dataclass(frozen=True)
class ConvertConfig:
    steps: int = 120            # optimiser steps per arm
    seq_len: int = 256          # tokens per training / held-out window (+1 for the target)
    batch: int = 1              # windows per step
    lr: float = 2e-3            # AdamW peak; linear warm-up, cosine decay to zero
    warmup: int = 8
    eval_docs: int = 16         # held-out documents, one window each
    seed: int = 0               # training window order

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch", "eval_docs"):
            if getattr(self, name) < 1:
                raise ConversionError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConversionError(f"lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise ConversionError(f"warmup must be ≥ 0, got {self.warmup}")


@dataclass(frozen=True)
class HeldOut:
    ids: torch.Tensor           # [N, seq_len + 1]; position 0 of each window is context only
    n_bytes: int                # UTF-8 bytes of the scored text (positions 1..seq_len)
    source: str = ""


def repair_set(model: CausalLM) -> dict[str, torch.nn.Parameter]:
    """Freeze the model and open `Wq` of every full-attention layer l ≥ 1: the queries the
    wiring moves. Returns them by state-dict name."""
    model.requires_grad_(False)
    params = {}
    for l, layer in enumerate(model.model.layers):
        if l > 0 and layer.kind == FULL_ATTENTION:
            params[f"model.layers.{l}.self_attn.q_proj.weight"] = \
                layer.self_attn.q_proj.weight.requires_grad_(True)
    if not params:
        raise ConversionError("no full-attention layer above layer 0: nothing to rewire")
    return params


def rewire(model: CausalLM) -> CausalLM:
    """The same weights with the query read point moved (what config.json will record)."""
    model.config = dataclasses.replace(model.config, wiring="qfirst")
    return model


def lm_loss(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """windows [B, T+1] -> mean next-token NLL (nats) of positions 1..T, differentiable."""
    logits = train_logits(model, windows[:, :-1])                     # [B, T, vocab]
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


@torch.inference_mode()
def bits_per_byte(model: CausalLM, heldout: HeldOut) -> float:
    """Held-out bits per byte through the exact forward (the path the services match)."""
    nats = 0.0
    for window in heldout.ids:
        logits = model.forward(window[None, :-1])[0].float()           # [T, vocab]
        nats += F.cross_entropy(logits, window[1:], reduction="sum").item()
    return nats / math.log(2) / heldout.n_bytes


def fine_tune(model: CausalLM, params: list[torch.nn.Parameter], train: torch.Tensor,
              cfg: ConvertConfig, log=print, tag: str = "") -> list[float]:
    """AdamW on `params` over `train` [N, T+1] in order, cfg.batch windows a step
    (wrapping round when the steps outlast the data). Returns the per-step losses."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    losses, start = [], time.perf_counter()
    for step in range(cfg.steps):
        rows = torch.arange(step * cfg.batch, (step + 1) * cfg.batch) % len(train)
        loss = lm_loss(model, train[rows])
        opt.zero_grad()
        loss.backward()
        warm = min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else 1.0
        for group in opt.param_groups:
            group["lr"] = cfg.lr * warm * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == cfg.steps - 1:
            log(f"[convert-qfirst] {tag} step {step}: loss {loss.item():.4f} "
                f"({time.perf_counter() - start:.0f}s)")
    return losses


def save_converted(src_dir: Path, out_dir: Path, repaired: dict[str, torch.Tensor]) -> Path:
    """Write the source checkpoint with the repaired tensors swapped in (same names and
    dtypes, one safetensors file) and `splitstack_wiring: qfirst` in its config."""
    state = {}
    for file in safetensors_files(src_dir):
        with safe_open(str(file), framework="pt") as f:
            for raw in f.keys():
                tensor = f.get_tensor(raw)
                name = normalize_name(raw)
                if name in repaired:
                    tensor = repaired[name].detach().to(tensor.dtype)
                state[raw] = tensor.contiguous()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for path in src_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" \
                and path.name not in ("model.safetensors.index.json", "config.json", RESULT_FILE):
            shutil.copy(path, tmp / path.name)
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg["splitstack_wiring"] = "qfirst"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _arm(model_dir: Path, converted: bool, train: torch.Tensor, heldout: HeldOut,
         cfg: ConvertConfig, log) -> tuple[CausalLM, dict[str, torch.nn.Parameter], dict]:
    tag = "converted" if converted else "unconverted"
    start = time.perf_counter()
    model = load_model(model_dir)
    if converted:
        rewire(model)
    before = bits_per_byte(model, heldout)
    log(f"[convert-qfirst] {tag}: {before:.4f} bits/byte before the fine-tune")
    params = repair_set(model)
    losses = fine_tune(model, list(params.values()), train, cfg, log, tag)
    after = bits_per_byte(model, heldout)
    log(f"[convert-qfirst] {tag}: {after:.4f} bits/byte after it")
    tail = losses[-10:]
    return model, params, {"bpb_before_sft": before, "bpb_after_sft": after,
                           "train_loss_first": losses[0],
                           "train_loss_last10": sum(tail) / len(tail),
                           "seconds": round(time.perf_counter() - start, 1)}


def convert_qfirst(model_dir: str | Path, out_dir: str | Path, train: torch.Tensor,
                   heldout: HeldOut, cfg: ConvertConfig, log=print, source: str = "") -> dict:
    """Convert `model_dir` into `out_dir` and measure d. `train` [N, T+1] are the training
    windows (from `source`) in the order both arms read them. Returns what it writes to
    RESULT_FILE."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    start = time.perf_counter()
    probe = load_model(model_dir)
    if probe.config.wiring != "standard":
        raise ConversionError(f"{model_dir} is already wired {probe.config.wiring!r}")
    total = sum(p.numel() for p in probe.parameters())
    opened = repair_set(probe)
    trainable = sum(p.numel() for p in opened.values())
    layers = [int(name.split(".")[2]) for name in opened]
    del probe, opened
    model, params, conv = _arm(model_dir, True, train, heldout, cfg, log)
    save_converted(model_dir, out_dir, params)
    del model, params
    _, _, ref = _arm(model_dir, False, train, heldout, cfg, log)
    result = {
        "model": str(model_dir), "out": str(out_dir), "wiring": "qfirst",
        "repaired": f"q_proj of full-attention layers {layers}", "objective": "next-token NLL",
        "trainable_params": trainable, "trainable_share": round(trainable / total, 4),
        "budget": {"steps": cfg.steps, "seq_len": cfg.seq_len, "batch": cfg.batch,
                   "lr": cfg.lr, "warmup": cfg.warmup, "schedule": "linear warm-up, cosine",
                   "optimizer": "AdamW (weight decay 0)", "seed": cfg.seed,
                   "tokens_per_arm": cfg.steps * cfg.batch * cfg.seq_len,
                   "train_windows": len(train), "threads": torch.get_num_threads()},
        "data": source,
        "heldout": {"source": heldout.source, "windows": len(heldout.ids),
                    "tokens": heldout.ids[:, 1:].numel(), "bytes": heldout.n_bytes},
        "bpb": {"unconverted": ref["bpb_before_sft"], "rewired": conv["bpb_before_sft"],
                "unconverted_sft": ref["bpb_after_sft"], "converted_sft": conv["bpb_after_sft"]},
        "untrained": conv["bpb_before_sft"] - ref["bpb_before_sft"],
        "d": conv["bpb_after_sft"] - ref["bpb_after_sft"],
        "arms": {"converted": conv, "unconverted": ref},
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    return result


def corpus_data(model_dir: str | Path, cfg: ConvertConfig,
                train_files: list[str] | None = None) -> tuple[torch.Tensor, HeldOut, str]:
    """Training windows (the corpus's calibration split, or `train_files`), shuffled by
    cfg.seed, and one held-out window from each of the first cfg.eval_docs documents of the
    evaluation split long enough; the two splits never share a file (evals/corpus.py)."""
    from evals.corpus import SOURCE_NAME, documents
    from services.common.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    if train_files:
        texts = [Path(p).read_text(encoding="utf-8", errors="replace") for p in train_files]
        source = ", ".join(train_files)
    else:
        texts, source = [d.text for d in documents("calib")], f"{SOURCE_NAME} (calib split)"
    n = cfg.seq_len + 1
    ids = torch.tensor(encode("\n\n".join(texts)))
    if len(ids) < n:
        raise ConversionError(f"training text has {len(ids)} tokens, fewer than one window "
                              f"of {n}")
    windows = ids[: len(ids) // n * n].view(-1, n)
    train = windows[torch.randperm(len(windows),
                                   generator=torch.Generator().manual_seed(cfg.seed))]
    held, n_bytes = [], 0
    for doc in documents("eval"):
        doc_ids = encode(doc.text)
        if len(doc_ids) >= n:
            held.append(doc_ids[:n])
            n_bytes += len(tok.decode(doc_ids[1:n], clean_up_tokenization_spaces=False)
                           .encode("utf-8"))
        if len(held) == cfg.eval_docs:
            break
    if len(held) < cfg.eval_docs:
        raise ConversionError(f"only {len(held)} held-out documents reach {n} tokens, "
                              f"asked for {cfg.eval_docs}")
    return train, HeldOut(torch.tensor(held), n_bytes, f"{SOURCE_NAME} (eval split)"), source
