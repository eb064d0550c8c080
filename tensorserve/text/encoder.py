"""``TextEncoder``: texts in, each one's token ids, attention mask and whether
it was truncated out, with one ``encode_batch`` call for the whole lot.

Each text is bounded first by the tokenizer cut rule (``cut_rule.py``), so a
1 MiB text costs what its first ``max_length`` tokens cost, and its ids and
mask are exactly those of the whole text encoded then truncated. A text the
rule leaves long is encoded from ever longer prefixes cut at whitespace,
until one overflows ``max_length`` (or the whole text is reached).

Whether a text was truncated is read from the encoding itself (its
``overflowing`` part): the rule is built to keep one unit more than
``max_length`` leaves room for, so a bounded text that was longer than the
limit still overflows it. Plain Python on ``tokenizers`` (Rust, no torch):
it runs on the request pool of whichever process tokenizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from tensorserve.text.cut_rule import CutRule, cut_rule

# A bounded text longer than this many characters per kept token is encoded a
# prefix at a time: ordinary text has 4 to 6, so only the texts the rule could
# not shorten pay for more than one encoding.
CHARACTERS_PER_TOKEN = 16


@dataclass(frozen=True)
class EncodedText:
    """One text's tokens, as the model's inputs take them."""

    input_ids: np.ndarray  # int64 [tokens], special tokens included
    attention_mask: np.ndarray  # int64 [tokens], all ones (no padding here)
    truncated: bool  # the text had more tokens than max_length


class TextEncoder:
    """A tokenizer truncating at ``max_length`` (special tokens included),
    never padding: padding is the batcher's, per batch."""

    def __init__(self, tokenizer: Tokenizer, max_length: int) -> None:
        self.max_length = max_length
        self.tokenizer = tokenizer
        tokenizer.no_padding()
        # One token more than is kept: a text cut by the rule still overflows
        # when it was longer than the limit, so ``truncated`` is exact.
        tokenizer.enable_truncation(max_length + 1)
        self.cut: CutRule | None = cut_rule(tokenizer)
        tokenizer.enable_truncation(max_length)

    @classmethod
    def from_file(cls, path: str, max_length: int) -> TextEncoder:
        return cls(Tokenizer.from_file(path), max_length)

    def encode(self, texts: Sequence[str]) -> list[EncodedText]:
        """Each text's ids and mask, in order; one ``encode_batch`` call for
        every text the rule bounded short."""
        encodings = self.encodings(texts)
        return [
            EncodedText(
                np.asarray(e.ids, dtype=np.int64),
                np.asarray(e.attention_mask, dtype=np.int64),
                bool(e.overflowing),
            )
            for e in encodings
        ]

    def encodings(self, texts: Sequence[str]) -> list[Any]:
        """The ``tokenizers`` encodings of ``texts``, each truncated."""
        if self.cut is None:
            return list(self.tokenizer.encode_batch(list(texts)))
        bounded = [self.cut.bound(text) for text in texts]
        long_after = CHARACTERS_PER_TOKEN * self.max_length
        encodings = self.tokenizer.encode_batch(
            ["" if len(text) > long_after else text for text in bounded]
        )
        for row, text in enumerate(bounded):
            if len(text) > long_after:
                for prefix in self.cut.prefixes(text, long_after):
                    encodings[row] = self.tokenizer.encode(prefix)
                    if encodings[row].overflowing:
                        break  # the prefix made more tokens than are kept
        return list(encodings)
