"""Sentence embedder: tiny Transformer encoder + masked mean pooling + L2 norm.

Embedding(vocab_size, d_model) + learned positional embedding (max_len)
-> nn.TransformerEncoder (n_layers, post-norm, ReLU, dropout 0, batch_first)
-> mean over real tokens (attention_mask == 1) -> L2-normalise.

forward(input_ids [B, T] int64, attention_mask [B, T] int64 (1 = real token,
0 = padding)) -> embedding [B, d_model] float32, unit L2 norm per row.

Served, it also takes the request parameter ``normalize`` (config.toml's
``[[request_parameter]]``: one bool per row, default true; false gives the
mean-pooled vector as it is) and returns each row's pooled L2 norm as the
output parameter ``norm`` (``tensorserve.WithParameters``). Called without
``normalize`` (a script, a test) it returns the unit-norm tensor alone.

Padded positions are excluded both from attention (src_key_padding_mask) and
from the pooling, so a right-padded row yields the same embedding as the item
run alone.  Off the CPU, forward reads no value on the host (a GPU never
waits for it).  Imports torch, and tensorserve for ``WithParameters``.
"""

import torch
from torch import nn

from tensorserve import WithParameters


class Model(nn.Module):
    def __init__(
        self,
        vocab_size: int = 4096,
        d_model: int = 64,
        n_heads: int = 2,
        n_layers: int = 1,
        d_ff: int = 128,
        max_len: int = 512,
    ) -> None:
        super().__init__()
        self.max_len = int(max_len)
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model=d_model,
            nhead=n_heads,
            dim_feedforward=d_ff,
            dropout=0.0,
            batch_first=True,
        )
        # The default nested-tensor fast path: in eval mode under inference_mode,
        # padded positions (attention_mask == 0) are skipped, not computed.
        self.encoder = nn.TransformerEncoder(
            layer, num_layers=n_layers
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        normalize: list[bool] | None = None,
    ) -> torch.Tensor | WithParameters:
        seq_len = input_ids.shape[1]
        if seq_len > self.max_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_len {self.max_len}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.embed(input_ids) + self.pos_embed(positions)[None, :, :]
        pad_mask = attention_mask == 0
        # Guard against rows with no real tokens (all-masked softmax -> NaN),
        # without reading the mask on the host: on a GPU that would wait for it.
        pad_mask[:, 0] &= ~pad_mask.all(dim=1)
        h = self._encode(x, pad_mask)
        keep = (~pad_mask).to(h.dtype).unsqueeze(-1)  # [B, T, 1]
        pooled = (h * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        unit = nn.functional.normalize(pooled, p=2.0, dim=-1, eps=1e-12)
        if normalize is None:
            return unit
        # One flag per row: rows of callers that asked for raw vectors keep them.
        # Copied without waiting: a blocking copy to a GPU synchronises it, and
        # from pinned memory on CUDA, so that the copy is queued, not staged.
        flags = torch.tensor(normalize, pin_memory=unit.is_cuda)
        rows = flags.to(unit.device, non_blocking=True)[:, None]
        embedding = torch.where(rows, unit, pooled)
        return WithParameters({"embedding": embedding}, {"norm": pooled.norm(dim=-1)})

    def _encode(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # Reading the mask costs nothing on the CPU: a batch without
            # padding takes the dense fast path, one with padding the
            # nested-tensor path, which skips padded positions.
            return self.encoder(x, src_key_padding_mask=pad_mask if bool(pad_mask.any()) else None)
        return self._encode_padded(x, pad_mask)

    def _encode_padded(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        # Off the CPU, reading the mask or building a nested tensor (it needs
        # each row's length on the host) would make the host wait for the
        # device: every layer runs on the padded batch, padded keys masked out.
        for layer in self.encoder.layers:
            x = layer(x, src_key_padding_mask=pad_mask)
        return x
