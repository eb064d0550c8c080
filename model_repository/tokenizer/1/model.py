"""A tokenizer as a model: each row's string in, its token ids and attention
mask out, one row per caller, each its own length (``ragged = true``).

The whole batch is encoded by one ``encode_batch`` call of the Hugging Face
``tokenizers`` library, which runs in Rust: strings from every caller
queued in the same few milliseconds are tokenized together.

Texts may be up to 1 MiB, but only the first ``max_length`` tokens are kept,
so each text is first bounded by ``CutRule.bound``: cut after enough
token-bearing units, runs of whitespace made one space, and (WordPiece) an
over-long word shortened, all only where the ids and mask provably stay the
same; a text still long (characters it does not count: ones the normaliser
may drop, rare ones past the Basic Multilingual Plane) is then encoded from
ever longer prefixes cut at whitespace until one fills ``max_length``.
Encoding a 1 MiB text whole took about 100 MB and over a second; eight of
them held up every other text caller for seconds.

The rule lives in ``tensorserve/text/cut_rule.py``, shared with the
``huggingface_transformers`` platform, which tokenizes before admission.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from tensorserve.text.cut_rule import CutRule, cut_rule, learn_characters
from tensorserve.text.encoder import CHARACTERS_PER_TOKEN

VOCABULARY = Path(__file__).with_name("tokenizer.json")
__all__ = ["VOCABULARY", "CutRule", "Model", "cut_rule", "learn_characters"]


class Model(torch.nn.Module):
    def __init__(self, max_length: int = 512) -> None:
        super().__init__()
        self.tokenizer = Tokenizer.from_file(str(VOCABULARY))
        self.tokenizer.enable_truncation(max_length)  # [CLS] and [SEP] included
        self.max_length = max_length
        self.cut = cut_rule(self.tokenizer)

    def forward(self, TEXT: np.ndarray) -> dict[str, list[torch.Tensor]]:
        # TEXT: [batch, 1] bytes, UTF-8 (the input's utf8 = true checked it).
        texts = [row[0].decode("utf-8") for row in TEXT]
        if self.cut is None:
            encodings = self.tokenizer.encode_batch(texts)
        else:
            encodings = self._encode_bounded([self.cut.bound(text) for text in texts])
        return {
            "input_ids": [torch.tensor(e.ids, dtype=torch.int64) for e in encodings],
            "attention_mask": [
                torch.tensor(e.attention_mask, dtype=torch.int64) for e in encodings
            ],
        }

    def _encode_bounded(self, texts: list[str]) -> list[Any]:
        """One ``encode_batch`` for the texts ``bound`` made short; a text still
        long is encoded from its ``prefixes`` until one fills ``max_length``."""
        assert self.cut is not None
        long_after = CHARACTERS_PER_TOKEN * self.max_length
        encodings = self.tokenizer.encode_batch(
            ["" if len(text) > long_after else text for text in texts]
        )
        for row, text in enumerate(texts):
            if len(text) > long_after:
                for prefix in self.cut.prefixes(text, long_after):
                    encodings[row] = self.tokenizer.encode(prefix)
                    if len(encodings[row].ids) == self.max_length:
                        break  # the prefix made at least as many tokens as are kept
        return encodings
