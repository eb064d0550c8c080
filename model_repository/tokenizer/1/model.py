"""A tokenizer as a model: each row's string in, its token ids and attention
mask out, one row per caller, each its own length (``ragged = true``).

The whole batch is encoded by one ``encode_batch`` call of the Hugging Face
``tokenizers`` library, which runs in Rust: strings from every caller
queued in the same few milliseconds are tokenized together.

Texts may be up to 1 MiB, but only the first ``max_length`` tokens are kept,
so each text is first bounded by ``CutRule.bound``: cut after enough
token-bearing units, runs of whitespace made one space, and (WordPiece) an
over-long word shortened, all only where the ids and mask provably stay the
same; a text still long (words it does not count, such as Cyrillic) is then
encoded from ever longer prefixes cut at whitespace until one fills
``max_length``. Encoding a 1 MiB text whole took about 100 MB and over a
second; eight of them held up every other text caller for seconds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

VOCABULARY = Path(__file__).with_name("tokenizer.json")

# The normalisers that map each ASCII character to itself (or its lower case)
# and never compose it with a neighbour (so no NFC/NFKC: "=" + U+0338 is "≠"),
# and whose output for a text cut before or after an ASCII character is the
# same as the uncut text's output cut there (they work one character at a time;
# NFD's reordering never crosses an ASCII character).
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "StripAccents", "NFD", "NFKD"}
_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_POST_PROCESSORS = {None, "TemplateProcessing", "BertProcessing"}
_WHITESPACE = " \t\n\r"  # the ASCII whitespace every supported stage splits on and drops
_PUNCTUATION = r"!-/:-@\[-`{-~"  # ASCII punctuation: a piece of its own to BertPreTokenizer
# CJK Unified Ideographs: each a piece of its own once BertNormalizer has spaced them
# (the block is NFKD-stable and has no case; its neighbours are left out, unverified).
_CJK = "\u4e00-\u9fff"
_SPACES = re.compile(f"[{_WHITESPACE}]{{2,}}")
_NEXT_SPACE = re.compile(f"[{_WHITESPACE}]")
# A bounded text longer than this many characters per kept token is encoded a
# prefix at a time: ordinary text has 4 to 6, so only the texts bound could not
# shorten pay for more than one encoding.
_CHARACTERS_PER_TOKEN = 16


@dataclass(frozen=True)
class CutRule:
    """Bounds a text so that encoding it then truncating gives the same ids and
    attention mask as encoding the whole text then truncating.

    Why it holds, for the kinds ``cut_rule`` accepts:

    * A *unit* is text that makes at least one token wherever it stands: to
      ``BertPreTokenizer`` an ASCII punctuation character (always a piece of its
      own), a CJK ideograph where BertNormalizer spaces them, or a run of
      other non-whitespace characters holding an ASCII letter or digit; to
      ``Whitespace`` and ``WhitespaceSplit`` a run of non-whitespace holding
      any visible ASCII character. Runs of only other
      characters are not counted (the normaliser may drop them all: control
      characters, accents, U+FFFD), so the count never overstates the tokens.
    * The text is cut just after the ``keep``-th unit. The cut falls on a
      boundary every stage respects (ASCII whitespace, or either side of a
      character BertPreTokenizer isolates), so the cut text's pieces are the
      whole text's first pieces, each piece is encoded on its own, and its tokens
      are the first tokens of the whole text, at least ``keep`` of them: the
      truncated results are equal. With fewer units than ``keep`` only a tail
      of ASCII whitespace is dropped (it makes no tokens).
    * Runs of ASCII whitespace become one space: every supported stage treats
      one whitespace character as it treats many (they split, and are dropped).
    * WordPiece only: a run of more than ``max_input_chars_per_word + 1`` ASCII
      letters and digits lies inside one piece whose normalised length is at
      least the run's, so that piece is [UNK] whether the run is kept whole or
      shortened to ``max_input_chars_per_word + 1`` characters (its first ones
      and its last, so what touches either end is unchanged).

    Added tokens are matched in the raw text before all this: with any, units
    are only whitespace-separated runs (``[MASK]`` is one token, not three),
    and an added token holding a letter or digit turns the shortening off.
    """

    keep: int  # tokens left for the text once the special tokens are added
    # Matches the text up to the end of its keep-th unit, if it has that many.
    units: re.Pattern[str]
    # WordPiece's words past max_input_chars_per_word + 1 (the part to keep
    # in groups 1 and 2); None: no shortening.
    long_word: re.Pattern[str] | None

    def bound(self, text: str) -> str:
        """``text`` cut and rewritten as the class docstring says."""
        enough = self.units.match(text)
        # Fewer units than ``keep``: only trailing whitespace can go.
        kept = text[: enough.end()] if enough else text.rstrip(_WHITESPACE)
        kept = _SPACES.sub(" ", kept)
        if self.long_word is not None:
            kept = self.long_word.sub(r"\1\2", kept)
        return kept

    def prefixes(self, text: str, first: int) -> Iterator[str]:
        """Ever longer prefixes of ``text``, each cut before ASCII whitespace and
        the first at least ``first`` characters long, then ``text`` itself.

        For a text ``bound`` leaves long (words it does not count: Cyrillic,
        Arabic, accents only): each prefix's tokens are the text's first tokens
        (the cut is on a boundary, as in ``bound``), so the first prefix that
        fills ``max_length`` encodes to the text's own ids and mask."""
        length = first
        while length < len(text):
            cut = _NEXT_SPACE.search(text, length)
            if cut is None:
                break
            yield text[: cut.start()]
            length = 4 * cut.start()
        yield text


def cut_rule(tokenizer: Tokenizer) -> CutRule | None:
    """The rule that bounds this tokenizer's texts, or None where it uses a
    kind this rule is not proved for (then texts are encoded whole: correct,
    only slower). Supported: the normalisers in ``_LOCAL_NORMALIZERS`` (also
    in a Sequence); BertPreTokenizer, Whitespace, WhitespaceSplit (ByteLevel
    and Metaspace make tokens of spaces, so a run of them is not free);
    WordPiece, WordLevel and BPE without dropout whose unknown token is in the
    vocabulary (no piece makes no token, none fails); truncation from the right
    and no padding."""
    config: dict[str, Any] = json.loads(tokenizer.to_str())
    normalizers = _kinds(config.get("normalizer"), "normalizers")
    pre_tokenizer = (config.get("pre_tokenizer") or {}).get("type")
    model = config["model"]
    truncation = tokenizer.truncation
    if (
        not normalizers <= _LOCAL_NORMALIZERS
        or pre_tokenizer not in _PRE_TOKENIZERS
        or (config.get("post_processor") or {}).get("type") not in _POST_PROCESSORS
        or not _never_tokenless(model)
        or truncation is None
        or truncation["direction"] != "right"
        or tokenizer.padding is not None
    ):
        return None
    added = [token["content"] for token in config.get("added_tokens", [])]
    if any(not content or any(c.isspace() for c in content) for content in added):
        return None  # an added token could straddle the cut or a run of spaces made one
    keep = truncation["max_length"] - tokenizer.num_special_tokens_to_add(is_pair=False)
    if keep < 1:
        return None
    if pre_tokenizer == "BertPreTokenizer" and not added:
        punctuation, bearing = _PUNCTUATION, "A-Za-z0-9"
        if _separates_chinese(config["normalizer"]):
            punctuation += _CJK
    else:
        punctuation, bearing = "", "!-~"
    shortening = model["type"] == "WordPiece" and not any(
        re.search("[A-Za-z0-9]", c) for c in added
    )
    longest = model.get("max_input_chars_per_word")
    return CutRule(
        keep=keep,
        units=re.compile(f"(?:{_unit_pattern(punctuation, bearing)}){{{keep}}}"),
        long_word=re.compile(_long_word_pattern(longest)) if shortening else None,
    )


def _unit_pattern(punctuation: str, bearing: str) -> str:
    """Skip whitespace and runs that may make no token, then match one unit.
    Every quantifier is possessive, so a 1 MiB run is scanned in linear time."""
    space, other = f"[{_WHITESPACE}]", f"[^{_WHITESPACE}{punctuation}]"
    bare = f"[^{_WHITESPACE}{punctuation}{bearing}]"
    skip = f"(?:{space}++|{bare}++(?!{other}))*+"
    run = f"{bare}*+[{bearing}]{other}*+"
    return f"{skip}(?:[{punctuation}]|{run})" if punctuation else f"{skip}{run}"


def _long_word_pattern(longest: int) -> str:
    """A run of more than ``longest + 1`` ASCII letters and digits, its first
    ``longest`` characters in group 1 and its last in group 2."""
    alnum = "[A-Za-z0-9]"
    return f"(?<!{alnum})({alnum}{{{longest}}}){alnum}+({alnum})(?!{alnum})"


def _kinds(component: dict[str, Any] | None, members: str) -> set[str]:
    if component is None:
        return set()
    if component["type"] == "Sequence":
        return set().union(*(_kinds(c, members) for c in component[members]))
    return {component["type"]}


def _separates_chinese(normalizer: dict[str, Any] | None) -> bool:
    """Whether a BertNormalizer puts spaces round each CJK ideograph (which the
    later supported normalisers leave as it is)."""
    if normalizer is None:
        return False
    if normalizer["type"] == "Sequence":
        return any(_separates_chinese(n) for n in normalizer["normalizers"])
    return normalizer["type"] == "BertNormalizer" and bool(normalizer["handle_chinese_chars"])


def _never_tokenless(model: dict[str, Any]) -> bool:
    """Whether every non-empty piece makes at least one token and none fails."""
    if model["type"] == "BPE" and model.get("dropout") is not None:
        return False  # random merges: the same piece need not give the same ids twice
    if model["type"] not in {"WordPiece", "WordLevel", "BPE"}:
        return False
    return model.get("unk_token") in model["vocab"]


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
        long_after = _CHARACTERS_PER_TOKEN * self.max_length
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
