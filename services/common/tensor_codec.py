"""proto `Tensor` <-> torch.Tensor (dtype name, shape, raw C-contiguous bytes)."""
from __future__ import annotations

import numpy as np
import torch

from services.common.pb import splitstack_pb2 as pb

_NUMPY = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32,
          "bool": np.bool_, "float16": np.float16}


def to_proto(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    data = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return pb.Tensor(dtype=name, shape=list(t.shape), data=data)


def from_proto(msg: pb.Tensor) -> torch.Tensor:
    if msg.dtype == "bfloat16":
        arr = np.frombuffer(msg.data, dtype=np.int16).reshape(tuple(msg.shape))
        return torch.from_numpy(arr.copy()).view(torch.bfloat16)
    if msg.dtype not in _NUMPY:
        raise ValueError(f"unsupported tensor dtype {msg.dtype!r}")
    arr = np.frombuffer(msg.data, dtype=_NUMPY[msg.dtype]).reshape(tuple(msg.shape))
    return torch.from_numpy(arr.copy())
