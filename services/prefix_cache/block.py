"""One cached block of a prompt: its keys, rows, and their self-describing encoding.

A prompt is cut into blocks of `block_size` tokens; the last one may be partial. Each block
is keyed by a hash chained from the namespace (the model fingerprint), so equal keys mean
equal prefixes of the same model:

    tokens  t0 .. t15 | t16 .. t31 | t32 t33 t34
    key     h0        | h1         | h2           h_i = sha256(h_{i-1}, block_size, tokens_i)
                                     ^ partial, keyed by its own 3 tokens; always a leaf
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

EXACT, FILLED = 0, 1  # provenance of a row


class PrefixCacheError(ValueError):
    """Rows whose shapes disagree with the tokens; carries the offending shape."""

    def __init__(self, name: str, shape: tuple, expected: str):
        super().__init__(f"{name} has shape {shape}; expected {expected}")
        self.name, self.shape = name, shape


class CorruptBlock(Exception):
    """A stored block that fails to decode: bad magic or checksum, truncated, inconsistent."""


@dataclass(eq=False)
class Block:
    """`n <= block_size` consecutive rows of a prompt; tensors are contiguous CPU copies."""
    key: str
    parent: str
    tokens: tuple[int, ...]
    kv: torch.Tensor                 # [F, 2, n, KV, D]
    hidden: torch.Tensor | None      # [G, n, H]
    provenance: torch.Tensor         # uint8 [n]
    map_id: str | None
    pins: int = 0
    resident_kids: int = 0

    @property
    def nbytes(self) -> int:
        tensors = (self.kv, self.hidden, self.provenance)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def reusable_rows(self, reuse_filled: bool) -> int:
        filled = (self.provenance != EXACT).nonzero()
        return len(self.tokens) if reuse_filled or len(filled) == 0 else int(filled[0])


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def block_key(parent: str, block_size: int, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(parent.encode())
    h.update(block_size.to_bytes(8, "little"))
    h.update(token_bytes(tokens))
    return h.digest()[:16].hex()


def root_key(namespace: str) -> str:
    """h_{-1}: the namespace's digest, so every index key is 32 hex digits."""
    return hashlib.sha256(namespace.encode()).digest()[:16].hex()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_rows(n: int, kv: torch.Tensor, hidden: torch.Tensor | None,
               provenance: torch.Tensor) -> None:
    """Raise `PrefixCacheError` unless the tensors hold `n` rows each."""
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[2] != n:
        raise PrefixCacheError("kv", tuple(kv.shape), f"[F, 2, {n}, KV, D]")
    if hidden is not None and (hidden.dim() != 3 or hidden.shape[1] != n):
        raise PrefixCacheError("hidden", tuple(hidden.shape), f"[G, {n}, H]")
    if provenance.shape != (n,) or provenance.dtype != torch.uint8:
        raise PrefixCacheError("provenance", tuple(provenance.shape), f"uint8 [{n}]")


def copy_rows(t: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) along `dim` as a contiguous CPU copy that owns its storage."""
    return t.detach().narrow(dim, start, end - start).to(
        "cpu", copy=True, memory_format=torch.contiguous_format)


_MAGIC, _VERSION = b"SSPC", 1
_PREAMBLE = struct.Struct("<4sBI")  # magic, version, header bytes
_DIGEST = 32  # sha256 over everything before it


def encode_block(block: Block) -> bytes:
    """magic, version, header length | JSON header | tensor bytes | sha256 of all before."""
    tensors = {"kv": block.kv, "hidden": block.hidden, "provenance": block.provenance}
    tensors = {k: t for k, t in tensors.items() if t is not None}
    header = json.dumps({
        "parent": block.parent, "tokens": list(block.tokens), "map_id": block.map_id,
        "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for k, t in tensors.items()],
    }).encode()
    body = b"".join([_PREAMBLE.pack(_MAGIC, _VERSION, len(header)), header]
                    + [t.reshape(-1).view(torch.uint8).numpy().tobytes()
                       for t in tensors.values()])
    return body + hashlib.sha256(body).digest()


def decode_block(key: str, data: bytes, block_size: int) -> Block:
    """Inverse of `encode_block`; raises `CorruptBlock` unless `data` is intact and keyed `key`."""
    end = len(data) - _DIGEST
    if end < _PREAMBLE.size or hashlib.sha256(data[:end]).digest() != data[end:]:
        raise CorruptBlock(f"{key}: truncated or checksum mismatch")
    magic, version, header_len = _PREAMBLE.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptBlock(f"{key}: magic {magic!r} version {version}")
    try:
        header = json.loads(data[_PREAMBLE.size:_PREAMBLE.size + header_len])
        offset, tensors = _PREAMBLE.size + header_len, {}
        for name, dtype_name, shape in header["tensors"]:
            dtype = getattr(torch, dtype_name)
            size = math.prod(shape) * dtype.itemsize
            raw = bytearray(data[offset:offset + size])
            tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
            offset += size
        tokens = tuple(int(t) for t in header["tokens"])
        block = Block(key, header["parent"], tokens, tensors["kv"], tensors.get("hidden"),
                      tensors["provenance"], header["map_id"])
        check_rows(len(tokens), block.kv, block.hidden, block.provenance)
        intact = offset == end and tokens and block_key(block.parent, block_size, tokens) == key
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise CorruptBlock(f"{key}: {e}") from e
    if not intact:
        raise CorruptBlock(f"{key}: payload does not match its key")
    return block
