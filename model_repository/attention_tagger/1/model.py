"""Hand-written attention tagger: Embedding + positions -> 2 blocks of masked
single-head self-attention and a feed-forward layer -> Linear, per-token logits.

forward(input_ids [B, T] int64, attention_mask [B, T] int64) ->
logits [B, T, num_labels] float32.

Unlike nn.TransformerEncoder's nested-tensor fast path, nothing here skips
padded positions: every op runs on the whole padded [B, T] batch (attention
on [B, T, T]), so its compute grows with the padded volume. It exists to make
the cost of padding visible in benchmarks. Padded keys are masked out of the
softmax, so real positions equal the item run alone.
Self-contained: imports only torch and math.
"""

import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.norm2 = nn.LayerNorm(d_model)
        self.scale = 1.0 / math.sqrt(d_model)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scale + key_bias
        x = self.norm1(x + self.out(torch.matmul(scores.softmax(dim=-1), v)))
        return self.norm2(x + self.ff(x))


class Model(nn.Module):
    def __init__(
        self,
        vocab_size: int = 4096,
        d_model: int = 128,
        d_ff: int = 256,
        n_layers: int = 2,
        num_labels: int = 9,
        max_len: int = 512,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, d_ff) for _ in range(n_layers))
        self.head = nn.Linear(d_model, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)[None]
        # -inf would give NaN for a row with no real token; a large negative
        # number masks padded keys just as well.
        key_bias = (attention_mask[:, None, :] == 0).to(x.dtype) * -1e9
        for block in self.blocks:
            x = block(x, key_bias)
        return self.head(x)
