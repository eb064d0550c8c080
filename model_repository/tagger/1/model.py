"""Token tagger: a small Transformer encoder that emits per-token label logits.

Embedding(vocab_size, d_model) + learned positional embedding (max_len)
-> nn.TransformerEncoder (post-norm, ReLU, dropout 0, batch_first)
-> Linear(d_model, num_labels).

forward(input_ids [B, T] int64, attention_mask [B, T] int64 (1 = real token,
0 = padding)) -> logits [B, T, num_labels] float32.

Padding is right-padding.  Padded key positions are excluded from attention via
``src_key_padding_mask = attention_mask == 0``, so the logits at real positions
of a padded row equal those of the same item run alone (checked both on the
fused eval-mode fast path and the regular path).  Logits at padded positions
are unspecified and are meant to be sliced off.  Off the CPU, forward reads
no value on the host (a GPU never waits for it); on the CPU it skips padded
positions with a nested tensor.  Self-contained: imports only torch.
"""

import torch
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
        self.head = nn.Linear(d_model, num_labels)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.max_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_len {self.max_len}")
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.embed(input_ids) + self.pos_embed(positions)[None, :, :]
        if attention_mask is None:
            return self.head(self.encoder(x))
        pad_mask = attention_mask == 0
        # A row with no real tokens at all (never produced by right-padding
        # a non-empty item) would make softmax over an all-masked row NaN;
        # unmask its first position so the batch stays finite. Written
        # without reading the mask on the host: on a GPU that would wait for it.
        pad_mask[:, 0] &= ~pad_mask.all(dim=1)
        return self.head(self._encode(x, pad_mask))

    def _encode(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # Reading the mask costs nothing on the CPU: a batch without
            # padding takes the dense fast path (a mask would cost a nested
            # tensor, ~1.7x at 16 tokens), one with padding the nested-tensor
            # path, which skips padded positions.
            return self.encoder(x, src_key_padding_mask=pad_mask if bool(pad_mask.any()) else None)
        return self._encode_padded(x, pad_mask)

    def _encode_padded(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        # Off the CPU, reading the mask or building a nested tensor (it needs
        # each row's length on the host) would make the host wait for the
        # device: every layer runs on the padded batch, padded keys masked out.
        for layer in self.encoder.layers:
            x = layer(x, src_key_padding_mask=pad_mask)
        return x
