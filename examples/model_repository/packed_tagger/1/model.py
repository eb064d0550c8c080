"""The bundled tagger on packed batches: the same modules and weights as
model_repository/tagger, with no padding anywhere.

forward(input_ids [T] int64: the batch's items concatenated,
        cu_seqlens [B + 1] int64: 0, then each item's end in input_ids,
        max_seqlen [L] int32: only its length is read, the longest item's)
-> logits [T, num_labels] float32, concatenated as input_ids is; the server
splits them into each caller's rows by the lengths of input_ids.

Each item attends to itself only, and no padded position is ever computed;
positions restart at 0 in each item. ``attention`` says how:

* "nested": a nested jagged tensor (torch.nested.nested_tensor_from_jagged)
  with scaled_dot_product_attention, which on CUDA takes the varlen
  flash / memory-efficient kernels. Nothing reads a tensor's value on the
  host (max_seqlen is a shape), so the GPU never waits for the host.
* "segments": scaled_dot_product_attention on each item's slice in turn.
  On the CPU, torch 2.13 runs a nested SDPA through its math fallback, which
  pads the batch again inside (to_padded_tensor, masked_select): 4-7x slower
  than this loop on a 2-core VM (32 items of 8..128 and 8..512 tokens).
* "auto" (the default): nested on a GPU, segments on the CPU.

Both equal the padded tagger's logits for each item within 1e-5 (float32,
CPU; tests/test_packed_tagger.py). Imports only torch.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(
        self,
        vocab_size: int = 4096,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        d_ff: int = 256,
        num_labels: int = 9,
        max_len: int = 512,
        attention: str = "auto",
    ) -> None:
        super().__init__()
        if attention not in ("auto", "nested", "segments"):
            raise ValueError(f"attention must be auto, nested or segments, got {attention!r}")
        self.attention = attention
        # The tagger's modules under the tagger's names: its weights load as they are.
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model=d_model, nhead=n_heads, dim_feedforward=d_ff, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_labels)

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: torch.Tensor
    ) -> torch.Tensor:
        total = input_ids.shape[0]
        offsets = cu_seqlens.to(torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        # Each token's position in its own item: its index less its item's start.
        starts = offsets[:-1].repeat_interleave(lengths, output_size=total)
        positions = torch.arange(total, device=input_ids.device) - starts
        x = self.embed(input_ids) + self.pos_embed(positions)
        nested = self.attention == "nested" or (self.attention == "auto" and x.device.type != "cpu")
        # The segments' bounds on the host: free on the CPU, where they are needed.
        bounds = None if nested else offsets.tolist()
        longest = max_seqlen.shape[-1]
        for layer in self.encoder.layers:  # post-norm, as nn.TransformerEncoderLayer
            attention = layer.self_attn
            if bounds is None:
                attended = self._attend_nested(attention, x, offsets, longest)
            else:
                attended = self._attend_segments(attention, x, bounds)
            x = layer.norm1(x + attended)
            x = layer.norm2(x + layer.linear2(layer.activation(layer.linear1(x))))
        return self.head(x)

    @staticmethod
    def _attend_segments(
        attention: nn.MultiheadAttention, x: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        qkv = F.linear(x, attention.in_proj_weight, attention.in_proj_bias)
        # [1, heads, T, head_dim]: four dimensions take the CPU's fused kernel, not the math one.
        q, k, v = (
            t.unflatten(-1, (attention.num_heads, -1)).transpose(0, 1)[None] for t in qkv.chunk(3, -1)
        )
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
                )
                for start, end in zip(bounds[:-1], bounds[1:])
            ],
            dim=2,
        )
        return attention.out_proj(out[0].transpose(0, 1).flatten(-2))

    @staticmethod
    def _attend_nested(
        attention: nn.MultiheadAttention, x: torch.Tensor, offsets: torch.Tensor, longest: int
    ) -> torch.Tensor:
        heads = attention.num_heads
        qkv = F.linear(x, attention.in_proj_weight, attention.in_proj_bias)
        # SDPA takes a jagged tensor whose values are contiguous: one per q, k, v.
        q, k, v = (
            torch.nested.nested_tensor_from_jagged(
                t.contiguous().unflatten(-1, (heads, -1)), offsets, max_seqlen=longest
            ).transpose(1, 2)
            for t in qkv.chunk(3, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, j, head_dim]
        return attention.out_proj(out.transpose(1, 2).values().flatten(-2))
