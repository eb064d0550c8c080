"""A tokenizer as a model: each row's string in, its token ids and attention
mask out, one row per caller, each its own length (``ragged = true``).

The whole batch is encoded by one ``encode_batch`` call of the Hugging Face
``tokenizers`` library, which runs in Rust: strings from every caller
queued in the same few milliseconds are tokenized together.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

VOCABULARY = Path(__file__).with_name("tokenizer.json")


class Model(torch.nn.Module):
    def __init__(self, max_length: int = 512) -> None:
        super().__init__()
        self.tokenizer = Tokenizer.from_file(str(VOCABULARY))
        self.tokenizer.enable_truncation(max_length)  # [CLS] and [SEP] included

    def forward(self, TEXT: np.ndarray) -> dict[str, list[torch.Tensor]]:  # noqa: N803
        # TEXT: [batch, 1] bytes, UTF-8 (the input's utf8 = true checked it).
        texts = [row[0].decode("utf-8") for row in TEXT]
        encodings = self.tokenizer.encode_batch(texts)
        return {
            "input_ids": [torch.tensor(e.ids, dtype=torch.int64) for e in encodings],
            "attention_mask": [torch.tensor(e.attention_mask, dtype=torch.int64) for e in encodings],
        }
