"""What a `Prefill` call carries, both ends: a prefilled prompt as events and back.

    ack  ->  PromptKV per full-attention layer  ->  PromptState per GDN layer  ->  logits

Under the `nccl` transport the KV and state events carry metadata only, and a `transfer`
event comes before the logits: the caller pulls the tensors over its link
(`services.prefill.server`).
"""
from __future__ import annotations

import torch

from models.config import ModelConfig
from services.common.codec import to_proto
from services.common.messages import PromptExport
from services.common.pb import splitstack_pb2 as pb

GRPC_OPTIONS = [("grpc.max_send_message_length", 512 << 20),
                ("grpc.max_receive_message_length", 512 << 20)]


def export_events(export: PromptExport, cfg: ModelConfig, encode=to_proto):
    """The KV and state events of an export; `encode` turns each tensor into its proto
    (`nccl_transport.meta` for metadata only), called in the order the events carry them."""
    for i, l in enumerate(cfg.full_attention_layers):
        yield pb.PrefillEvent(kv=pb.PromptKV(layer=l, k=encode(export.kv[i, 0]),
                                             v=encode(export.kv[i, 1])))
    for i, l in enumerate(cfg.linear_attention_layers):
        yield pb.PrefillEvent(state=pb.PromptState(layer=l, conv=encode(export.conv[i]),
                                                   recurrent=encode(export.recurrent[i])))


class ExportBuffers:
    """An n-token export being received: its tensors allocated, each KV or state event's
    destinations (`destinations(ev)` -> [(tensor, its proto)]), and the layers seen."""

    def __init__(self, cfg: ModelConfig, n: int, dtype: torch.dtype, device: torch.device):
        self.fa = {l: i for i, l in enumerate(cfg.full_attention_layers)}
        self.gdn = {l: i for i, l in enumerate(cfg.linear_attention_layers)}
        self.kv = torch.empty(len(self.fa), 2, n, cfg.num_key_value_heads, cfg.head_dim,
                              dtype=dtype, device=device)
        self.conv = self.rec = None
        if self.gdn:
            self.conv = torch.empty(len(self.gdn), cfg.gdn_conv_dim,
                                    cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
            self.rec = torch.empty(len(self.gdn), cfg.linear_num_value_heads,
                                   cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                   dtype=torch.float32, device=device)
        self.seen: set[int] = set()

    def destinations(self, ev: pb.PrefillEvent) -> list[tuple[torch.Tensor, pb.Tensor]]:
        part = ev.WhichOneof("part")
        if part == "kv":
            self.seen.add(ev.kv.layer)
            i = self.fa[ev.kv.layer]
            return [(self.kv[i, 0], ev.kv.k), (self.kv[i, 1], ev.kv.v)]
        self.seen.add(ev.state.layer)
        i = self.gdn[ev.state.layer]
        return [(self.conv[i], ev.state.conv), (self.rec[i], ev.state.recurrent)]

    def missing(self) -> list[int]:
        return sorted((set(self.fa) | set(self.gdn)) - self.seen)

    def export(self, logits: torch.Tensor) -> PromptExport:
        return PromptExport(self.kv, self.conv, self.rec, logits)
