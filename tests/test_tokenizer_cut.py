"""The tokenizer model bounds each text before encoding it (issue #52): the
bounded text, encoded and truncated, gives exactly the ids and attention mask
of the whole text encoded and truncated, and a 1 MiB text is encoded from a
prefix of a few thousand characters.

Checked for the bundled tokenizer and for tokenizers of each other supported
kind built here, on random texts mixing words, punctuation, whitespace runs,
accents and controls the normaliser drops, CJK, over-long words (ASCII and
not: Greek, Cyrillic, accented, mixed scripts) and added tokens; and each
kind not proved is left uncut.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import unicodedata
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tests.conftest import REPOSITORY

MODEL_FILE = REPOSITORY / "tokenizer" / "1" / "model.py"
MAX_LENGTHS = [3, 4, 9, 40, 512]
# Fragments chosen to sit on each side of every rule: whitespace runs of each
# ASCII kind, whitespace that is not ASCII (U+3000, NBSP), characters the
# BertNormalizer drops (\x00, \x0b, U+FFFD, U+200D, a lone accent) or maps
# (Kelvin sign, ligature, "≠" = "=" + U+0338), punctuation, CJK, and words
# either side of WordPiece's 100-character limit.
FRAGMENTS = [
    "word", "mask", "привет", "Ωμέγα", "Hello", "café", "naïve", "e\u0301", "\u0301", "\x00", "\x0b", "\x1c", "\ufffd", "\u200d",
    "中文", "字", "ｶ", "-", ",", "'", "[MASK]", "[mask]", "...", "≠", "=\u0338", "ﬁ", "\u212a", "ΑΣ",
    " ", "  ", "\t", "\n", "\r\n", " " * 300, "\u3000", "\xa0", "1234",
    "a" * 99, "b" * 100, "c" * 101, "Zy" * 75, "x" * 3000,
    "«", "»", "—", "·", "\u2028",
]  # fmt: skip
# Words that are not ASCII, at lengths either side of WordPiece's limits (20
# for the tokenizers built here, 100 for the bundled one), in word characters.
LONG_WORDS = {
    "greek": "ωμεγαλφαβητ",
    "greek capitals and accents": "ΩΜΈΓΑάέήί",
    "cyrillic": "приветжизнь",
    "combining marks": "e\u0301o\u0308\u0323",
    "hiragana and katakana": "ひらがなカタカナ",
    "mixed scripts": "aωж1éあ\u0301",
    "with vanishing controls": "ж\x00ω\u200d\ufeff",
}
WORD_LENGTHS = [19, 20, 21, 22, 50, 99, 100, 101, 102, 5000]
SEPARATORS = [
    "",
    " ",
    "«",
    "»",
    "\u3000",
    "\xa0",
    "中",
    "\U00020000",
    "\u0301",
    "😀",
    "\U00010000",
    "-",
]
CORPUS = [
    "The tagger reads a sentence and gives each token nine scores.",
    "Hello world, café naïve über. 中文字 - word, words; wordy!",
    "A much longer sentence, with several clauses, commas and a few unusual words in it.",
] * 20


def _load_model_module() -> ModuleType:
    # As tensorserve's loader does: by path, registered under a unique name.
    spec = importlib.util.spec_from_file_location(
        "tensorserve_models.tokenizer_cut_test", MODEL_FILE
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


MODEL = _load_model_module()


def _bundled() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL.VOCABULARY))


def _wordpiece_whitespace() -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=20))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        CORPUS,
        trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[MASK]", "mask"]),
    )
    return tokenizer


def _bpe_with_specials() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=specials)
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    return tokenizer


def _wordlevel_bert_with_specials() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(
        CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[MASK]", "mask"])
    )
    return tokenizer


def _wordpiece_bert(normalizer: normalizers.Normalizer) -> Tokenizer:
    """BertPreTokenizer with no added tokens (so its classes are learnt) and
    WordPiece's limit at 20, whose vocabulary holds every character of
    ``LONG_WORDS`` (so a word of them is [UNK] only when it is too long)."""
    vocab = _wordpiece_whitespace().get_vocab()
    for char in set(normalizer.normalize_str("".join(LONG_WORDS.values()))):
        vocab.setdefault(char, len(vocab))
        vocab.setdefault("##" + char, len(vocab))
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=20))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {
    "bundled": _bundled,
    # Accents are word characters here (kept), vanishing ones there (stripped).
    "wordpiece-bert-nfd-keeping-marks": lambda: _wordpiece_bert(
        normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    ),
    "wordpiece-bert-normalizer": lambda: _wordpiece_bert(normalizers.BertNormalizer()),
    "wordpiece-whitespace": _wordpiece_whitespace,
    "bpe-whitespacesplit-specials": _bpe_with_specials,
    "wordlevel-bert-specials": _wordlevel_bert_with_specials,
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]()


def _truncated(tokenizer: Tokenizer, max_length: int) -> Tokenizer:
    tokenizer.enable_truncation(max_length)
    return tokenizer


def _assert_same_encoding(tokenizer: Tokenizer, rule: Any, text: str) -> str:
    whole, bounded = tokenizer.encode(text), tokenizer.encode(rule.bound(text))
    assert bounded.ids == whole.ids, (text[:300], whole.tokens[-8:], bounded.tokens[-8:])
    assert bounded.attention_mask == whole.attention_mask
    return rule.bound(text)


@pytest.mark.parametrize("max_length", MAX_LENGTHS)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_bounded_text_encodes_to_the_same_ids_and_mask(
    tokenizer: Tokenizer, max_length: int, data: st.DataObject
) -> None:
    rule = MODEL.cut_rule(_truncated(tokenizer, max_length))
    assert rule is not None
    pieces = data.draw(
        st.lists(
            st.sampled_from(FRAGMENTS) | st.text(max_size=4) | _long_words(),
            max_size=3 * max_length,
        )
    )
    _assert_same_encoding(tokenizer, rule, "".join(pieces))


def _long_words() -> st.SearchStrategy[str]:
    return st.builds(
        _word_of, st.sampled_from(list(LONG_WORDS.values())), st.sampled_from(WORD_LENGTHS)
    )


def _word_of(letters: str, length: int) -> str:
    """``letters`` repeated to ``length`` characters."""
    return (letters * (length // len(letters) + 1))[:length]


@pytest.mark.parametrize("max_length", [4, 512])
@pytest.mark.parametrize("separator", SEPARATORS)
@pytest.mark.parametrize("script", list(LONG_WORDS))
def test_long_words_that_are_not_ascii_encode_to_the_same_ids_and_mask(
    tokenizer: Tokenizer, script: str, separator: str, max_length: int
) -> None:
    rule = MODEL.cut_rule(_truncated(tokenizer, max_length))
    assert rule is not None
    for length in WORD_LENGTHS:
        word = _word_of(LONG_WORDS[script], length)
        _assert_same_encoding(tokenizer, rule, separator.join([word, word, "x", word]))
        _assert_same_encoding(tokenizer, rule, word + separator + word[::-1] + separator)


# Each text with the most characters its bounded text may keep (for 510 tokens):
# about one character per token, or 102 per WordPiece word past the limit.
MEBIBYTE_TEXTS = {
    "words": ("word, " * (1 << 18), 6 * 510),
    "only whitespace": (" \t\n\r" * (1 << 18), 0),
    "one huge word": ("a" * (1 << 20), 101),
    "whitespace between two words": ("a" + " " * (1 << 20) + "b", 3),
    "punctuation": ("x-" * (1 << 19), 510),
    "cjk": ("中文" * (1 << 18), 510),
    "huge words": (("a" * 5000 + " ") * 210, 102 * 210),
    "one greek word of 2.5 MiB": ("ωμεγαλφα" * (5 << 17), 101),
    "one word of greek and combining marks": ("ε\u0301" * (1 << 19), 201),
    "cyrillic words": ("привет мир " * (1 << 16), 11 * 510),
    "words in guillemets": ("«слово»\u3000" * (1 << 17), 8 * 510),
    "words between no-break spaces": ("Ωμέγα\xa0" * (1 << 17), 6 * 510),
    "one emoji word": ("😀" * (1 << 18), 101),
    "cjk extension b": ("\U00020000" * (1 << 18), 510),
}


@pytest.mark.parametrize("name", list(MEBIBYTE_TEXTS))
def test_a_mebibyte_text_is_encoded_from_a_small_part_of_it(name: str) -> None:
    tokenizer = _truncated(_bundled(), 512)
    rule = MODEL.cut_rule(tokenizer)
    assert rule is not None
    text, most = MEBIBYTE_TEXTS[name]
    bounded = _assert_same_encoding(tokenizer, rule, text)
    assert len(bounded) <= most, len(bounded)


@pytest.mark.parametrize("max_length", MAX_LENGTHS)
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_each_prefix_encodes_to_the_first_tokens_of_the_whole_text(
    tokenizer: Tokenizer, max_length: int, data: st.DataObject
) -> None:
    rule = MODEL.cut_rule(_truncated(tokenizer, max_length))
    assert rule is not None
    tokenizer.no_truncation()
    pieces = data.draw(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=60))
    text = rule.bound("".join(pieces))
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    prefixes = list(rule.prefixes(text, data.draw(st.integers(1, 50))))
    assert prefixes[-1] == text
    for prefix in prefixes:
        ids = tokenizer.encode(prefix, add_special_tokens=False).ids
        assert ids == whole[: len(ids)], (prefix, text)


def test_the_model_bounds_each_text_and_answers_as_the_whole_text_would() -> None:
    model = MODEL.Model(max_length=64)
    assert model.cut is not None  # the bundled tokenizer's kinds are all supported
    texts = ["Hello world", "", "word " * 300_000, "a" * 300_000, " " * 300_000, "café naïve 中文"]
    texts += ["привет мир " * 100_000, "Ωμέγα" * 100, "ωμεγαλφα" * (5 << 17)]
    # Linear B is in short ranges past the Basic Multilingual Plane: bound does not
    # count it. Its first prefix (1,024 characters and on to a space) makes 13 tokens,
    # not 62: the model must go on to the next prefix (4,096 characters and on).
    texts += ["\U00010000" * 1000 + " \U00010000" * 100_000]
    rows = np.array([[t.encode()] for t in texts], dtype=object)
    reference = _truncated(_bundled(), 64)
    calls: list[str] = []
    model.tokenizer = _Spy(model.tokenizer, calls)
    out = model(rows)
    assert max(len(t) for t in calls) <= 4 * 16 * 64 + 4  # no more than a second prefix
    for text, ids, mask in zip(texts, out["input_ids"], out["attention_mask"], strict=True):
        expected = reference.encode(text)
        assert ids.tolist() == expected.ids
        assert mask.tolist() == expected.attention_mask


class _Spy:
    """Records every text the model encodes."""

    def __init__(self, tokenizer: Tokenizer, calls: list[str]) -> None:
        self._tokenizer, self._calls = tokenizer, calls

    def encode_batch(self, texts: list[str]) -> Any:
        self._calls.extend(texts)
        return self._tokenizer.encode_batch(texts)

    def encode(self, text: str) -> Any:
        self._calls.append(text)
        return self._tokenizer.encode(text)


def _tokenizer_with(change: Callable[[Tokenizer], None]) -> Tokenizer:
    tokenizer = _truncated(_bundled(), 64)
    change(tokenizer)
    return tokenizer


UNPROVED = {
    "ByteLevel pre-tokenizer": lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.ByteLevel()),
    "Metaspace pre-tokenizer": lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Metaspace()),
    "Punctuation pre-tokenizer": lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Punctuation()),
    "NFC normaliser (composes)": lambda t: setattr(t, "normalizer", normalizers.NFC()),
    "NFKC in a sequence": lambda t: setattr(
        t, "normalizer", normalizers.Sequence([normalizers.Lowercase(), normalizers.NFKC()])
    ),
    "Replace normaliser": lambda t: setattr(t, "normalizer", normalizers.Replace("a", " ")),
    "truncation from the left": lambda t: t.enable_truncation(64, direction="left"),
    "no truncation": lambda t: t.no_truncation(),
    "padding": lambda t: t.enable_padding(length=64),
    "an added token with a space": lambda t: t.add_tokens(["new york"]),
    "no room for text": lambda t: t.enable_truncation(2),
    "Unigram model": lambda t: setattr(t, "model", models.Unigram([("[UNK]", 0.0), ("a", -1.0)], 0)),
    "BPE with dropout": lambda t: setattr(t, "model", models.BPE({"[UNK]": 0, "a": 1}, [], dropout=0.5, unk_token="[UNK]")),
    "unknown token not in the vocabulary": lambda t: setattr(t, "model", models.WordPiece({"a": 0}, unk_token="[UNK]")),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(UNPROVED))
def test_a_kind_not_proved_is_encoded_whole(kind: str) -> None:
    assert MODEL.cut_rule(_tokenizer_with(UNPROVED[kind])) is None


def test_what_the_rule_assumes_of_the_bundled_tokenizer_holds() -> None:
    """Each ASCII punctuation mark and each CJK ideograph of U+4E00..U+9FFF is
    a piece of its own and makes a token; ASCII letters and digits survive
    normalisation one for one; each of " \\t\\n\\r" splits and makes none."""
    tokenizer = _bundled()
    normalize, pre_tokenize = (
        tokenizer.normalizer.normalize_str,
        tokenizer.pre_tokenizer.pre_tokenize_str,
    )
    isolated = [chr(c) for c in range(0x21, 0x7F) if not chr(c).isalnum()]
    isolated += [chr(c) for c in range(0x4E00, 0xA000)]
    for char in isolated:
        assert [p for p, _ in pre_tokenize(normalize("a" + char + "b"))] == ["a", char, "b"], repr(
            char
        )
        assert len(tokenizer.encode(char, add_special_tokens=False).ids) == 1
    alnum = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c).isalnum())
    assert len(normalize(alnum)) == len(alnum)
    for space in " \t\n\r":
        assert [p for p, _ in pre_tokenize(normalize("a" + space + "b"))] == ["a", "b"]
    assert tokenizer.encode("a" * 101, add_special_tokens=False).tokens == ["[UNK]"]


def test_the_classes_learnt_from_the_bundled_tokenizer() -> None:
    """Each character lands in the class its normalised image says (emoji and
    CJK extension B too), rare ones past the Basic Multilingual Plane in none;
    and no combining mark is split on (NFD moves only those, so it never moves
    a character that splits)."""
    tokenizer = _bundled()
    characters = MODEL.learn_characters(tokenizer)
    classes = {
        name: re.compile(f"[{getattr(characters, name)}]")
        for name in ("word", "vanishing", "spacing", "isolated")
    }
    expected = {
        "word": "aZ9ωΩΈжЖéあカ\u212a😀",
        "vanishing": "\x00\x0b\u0301\u200d\ufeff\ufffd",
        "spacing": " \t\n\r\u3000\xa0\u2028",
        "isolated": "!-~«»—·中\uf900\U00020000",
        "": "\U00010000\U000e0041\U000f0000",  # Linear B, a tag, private use
    }
    for name, chars in expected.items():
        for char in chars:
            found = [n for n, pattern in classes.items() if pattern.match(char)]
            assert found == ([name] if name else []), (repr(char), found)
    pre_tokenize = tokenizer.pre_tokenizer.pre_tokenize_str
    for code in range(0x110000):
        if unicodedata.combining(chr(code)):
            assert len(pre_tokenize(f"a{chr(code)}a")) == 1, hex(code)
