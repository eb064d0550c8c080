"""GRU token tagger: Embedding -> unidirectional GRU -> Linear, per-token logits.

forward(input_ids [B, T] int64, attention_mask [B, T] int64) ->
logits [B, T, num_labels] float32.

The GRU is run over the full padded length on purpose (no
pack_padded_sequence), so compute grows with the padded batch length; this
model exists to make padding cost visible in benchmarks.  Because the GRU is
unidirectional and padding is on the right, the outputs at real positions only
depend on earlier (real) tokens and equal those of the item run alone.
attention_mask is accepted for interface parity with `tagger` but not needed.
Self-contained: imports only torch.
"""

import torch
from torch import nn


class Model(nn.Module):
    def __init__(
        self,
        vocab_size: int = 4096,
        d_model: int = 128,
        hidden_size: int = 128,
        num_labels: int = 9,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.gru = nn.GRU(d_model, hidden_size, num_layers=1, batch_first=True)
        self.head = nn.Linear(hidden_size, num_labels)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        del attention_mask  # right padding never influences earlier positions
        h, _ = self.gru(self.embed(input_ids))
        return self.head(h)
