"""The tokenizer cut rule: bound a text before encoding it, so that a 1 MiB
text costs what its first ``max_length`` tokens cost, and the ids and
attention mask stay exactly those of the whole text encoded then truncated.

Used by the bundled tokenizer model (model_repository/tokenizer) and by the
``huggingface_transformers`` platform's tokenizing before admission
(``text/encoder.py``). Texts may be up to 1 MiB, but only the first
``max_length`` tokens are kept, so each text is first bounded by
``CutRule.bound``: cut after enough token-bearing units, runs of whitespace
made one space, and (WordPiece) an over-long word shortened, all only where
the ids and mask provably stay the same; a text still long (characters it
does not count: ones the normaliser may drop, rare ones past the Basic
Multilingual Plane) is then encoded from ever longer prefixes cut at
whitespace until one fills ``max_length``. Encoding a 1 MiB text whole took
about 100 MB and over a second; eight of them held up every other text
caller for seconds.

What each character is to the rule is learnt from the tokenizer itself, once
per normaliser: every assigned code point is normalised and its image
pre-tokenized (``learn_characters``, about 0.5 s). Needs ``tokenizers`` only
(no torch): a front-end process may import it.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

# The normalisers that map each ASCII character to itself (or its lower case)
# and never compose it with a neighbour (so no NFC/NFKC: "=" + U+0338 is "≠"),
# and whose output for a text cut before or after an ASCII character is the
# same as the uncut text's output cut there (they work one character at a time;
# NFD's reordering never crosses an ASCII character).
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "StripAccents", "NFD", "NFKD"}
_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_POST_PROCESSORS = {None, "TemplateProcessing", "BertProcessing"}
_WHITESPACE = " \t\n\r"  # the ASCII whitespace every supported stage splits on and drops
_SPACES = re.compile(f"[{_WHITESPACE}]{{2,}}")
_NEXT_SPACE = re.compile(f"[{_WHITESPACE}]")
# A regex set's code points of the Basic Multilingual Plane compile to one
# table, tested in constant time; those past it are ranges, tried one by one
# for each character the table does not hold. So past it only a class's ranges
# of at least this many code points are kept (most emoji, the CJK extensions):
# a character left out of every class is only not counted nor shortened, which
# is always safe.
_SHORTEST_ASTRAL_RANGE = 256
_PLANE = 0x10000
# Planes 0 to 3 are classified; past them are only tags, variation selectors
# and private use, in ranges too short or unassigned.
_CLASSIFIED = 0x40000
# Joins single characters for one normaliser call: a starter (NFD never moves
# a character across it) that each supported normaliser keeps as it is.
_SEPARATOR = "|"
# A bounded text longer than this many characters per kept token is encoded a
# prefix at a time: ordinary text has 4 to 6, so only the texts bound could not
# shorten pay for more than one encoding.
_CHARACTERS_PER_TOKEN = 16


@dataclass(frozen=True)
class Characters:
    """What each character is to ``CutRule``, by its normalised *image* (the
    character normalised alone); each field is a regex set's body."""

    word: str  # image not empty, and the pre-tokenizer splits on none of it
    vanishing: str  # image empty
    spacing: str  # image only characters the pre-tokenizer splits on and drops
    # Image split at both ends, holding a character that is not dropped: it
    # makes at least one token, wherever it stands.
    isolated: str
    bearing: str  # a run of characters holding one of these makes a token


# For pre-tokenizers other than BertPreTokenizer, and with added tokens.
_ASCII = Characters(word="A-Za-z0-9", vanishing="", spacing=_WHITESPACE, isolated="", bearing="!-~")
# Per normaliser (its JSON), what BertPreTokenizer makes of each character.
_LEARNT: dict[str, Characters] = {}


@dataclass(frozen=True)
class CutRule:
    """Bounds a text so that encoding it then truncating gives the same ids and
    attention mask as encoding the whole text then truncating.

    Why it holds, for the kinds ``cut_rule`` accepts:

    * ``Characters`` says what each character's image is. The supported
      normalisers work one character at a time but for NFD's reordering of
      combining marks, which never moves a character across a starter, and
      every character a pre-tokenizer splits on is a starter: so an image is
      the same in any text, a run of word and vanishing characters lies inside
      one piece, and there is a split just before and just after the image of
      a spacing or isolated character. With ``BertPreTokenizer`` and no added
      tokens the classes are learnt from the tokenizer (``learn_characters``);
      otherwise ASCII's are used (``_ASCII``).
    * A *unit* is text that makes at least one token wherever it stands: an
      isolated character (ASCII punctuation, "«", a CJK ideograph that
      BertNormalizer spaces), or a run of other characters between spacing
      and isolated ones holding a bearing character (a word character; to
      ``Whitespace`` and ``WhitespaceSplit`` any visible ASCII character).
      Runs of only other characters are not counted (the normaliser may drop
      them all: control characters, accents, U+FFFD), so the count never
      overstates the tokens.
    * The text is cut just after the ``keep``-th unit, and the rest of it is
      never scanned. The cut falls on a split (before a spacing or isolated
      character, or after an isolated one), so the cut text's pieces are the
      whole text's first pieces, each piece is encoded on its own, and its
      tokens are the first tokens of the whole text, at least ``keep`` of
      them: the truncated results are equal. With fewer units than ``keep``
      only a tail of ASCII whitespace is dropped (it makes no tokens).
    * Runs of ASCII whitespace become one space: every supported stage treats
      one whitespace character as it treats many (they split, and are dropped).
    * WordPiece only: a run of word and vanishing characters holding more than
      ``max_input_chars_per_word`` word characters lies inside one piece whose
      normalised length is at least that many, so that piece is [UNK] whether
      the run is kept whole or shortened to its first
      ``max_input_chars_per_word`` word characters and its last one (with the
      vanishing characters among and after them, so what touches either end is
      unchanged).

    Added tokens are matched in the raw text before all this: with any, units
    are only whitespace-separated runs (``[MASK]`` is one token, not three),
    and an added token holding a letter or digit turns the shortening off.
    """

    keep: int  # tokens left for the text once the special tokens are added
    # Matches the text up to the end of its keep-th unit, if it has that many.
    units: re.Pattern[str]
    # WordPiece's words past max_input_chars_per_word word characters (the
    # part to keep in groups 1 and 2); None: no shortening.
    long_word: re.Pattern[str] | None

    def bound(self, text: str) -> str:
        """``text`` cut and rewritten as the class docstring says."""
        enough = self.units.match(text)
        # Fewer units than ``keep``: only trailing whitespace can go.
        kept = text[: enough.end()] if enough else text.rstrip(_WHITESPACE)
        if self.long_word is not None:  # first: a long word is all a text may hold
            kept = self.long_word.sub(r"\1\2", kept)
        return _SPACES.sub(" ", kept)

    def prefixes(self, text: str, first: int) -> Iterator[str]:
        """Ever longer prefixes of ``text``, each cut before ASCII whitespace and
        the first at least ``first`` characters long, then ``text`` itself.

        For a text ``bound`` leaves long (characters it does not count: past
        the Basic Multilingual Plane in short runs of code points; runs of
        only vanishing characters; with other pre-tokenizers, words of no
        ASCII character):
        each prefix's tokens are the text's first tokens (the cut is on a
        boundary, as in ``bound``), so the first prefix that fills
        ``max_length`` encodes to the text's own ids and mask."""
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
        characters = learn_characters(tokenizer)
    else:
        characters = _ASCII
    shortening = model["type"] == "WordPiece" and not any(
        re.search("[A-Za-z0-9]", c) for c in added
    )
    longest = model.get("max_input_chars_per_word")
    return CutRule(
        keep=keep,
        units=re.compile(f"(?:{_unit_pattern(characters)}){{{keep}}}"),
        long_word=re.compile(_long_word_pattern(characters, longest)) if shortening else None,
    )


def _unit_pattern(characters: Characters) -> str:
    """Skip spacing and runs that may make no token, then match one unit.
    Every quantifier is possessive, so a 1 MiB run is scanned in linear time."""
    spacing, isolated, bearing = characters.spacing, characters.isolated, characters.bearing
    space, other = f"[{spacing}]", f"[^{spacing}{isolated}]"
    bare = f"[^{spacing}{isolated}{bearing}]"
    skip = f"(?:{space}++|{bare}++(?!{other}))*+"
    run = f"{bare}*+[{bearing}]{other}*+"
    return f"{skip}(?:[{isolated}]|{run})" if isolated else f"{skip}{run}"


def _long_word_pattern(characters: Characters, longest: int) -> str:
    """A run of word and vanishing characters holding more than ``longest``
    word characters: group 1 up to its ``longest``-th word character, group 2
    its last word character and the vanishing ones after it. Linear: the
    middle is taken greedily and given back only over the trailing vanishing
    characters."""
    word, vanishing = f"[{characters.word}]", characters.vanishing
    either = f"[{characters.word}{vanishing}]"
    vanish = f"[{vanishing}]*+" if vanishing else ""
    return f"(?<!{either})((?:{vanish}{word}){{{longest}}}){either}*({word}{vanish})(?!{either})"


def learn_characters(tokenizer: Tokenizer) -> Characters:
    """``Characters`` for this tokenizer's normaliser and ``BertPreTokenizer``
    over the assigned code points of planes 0 to 3: each character is
    normalised alone and the characters of every image are pre-tokenized.
    Learnt once per normaliser."""
    key = json.dumps(json.loads(tokenizer.to_str())["normalizer"], sort_keys=True)
    if key not in _LEARNT:
        chars = [chr(c) for c in range(_CLASSIFIED) if _assigned(chr(c))]
        images = _images(tokenizer, chars)
        dropped, isolated = _splitting(tokenizer, sorted(set("".join(images))))
        splitting = dropped | isolated
        classes: dict[str, list[str]] = {"word": [], "vanishing": [], "spacing": [], "isolated": []}
        for char, image in zip(chars, images, strict=True):
            if not image:
                classes["vanishing"].append(char)
            elif splitting.isdisjoint(image):
                classes["word"].append(char)
            elif image[0] in splitting and image[-1] in splitting:
                classes["spacing" if dropped.issuperset(image) else "isolated"].append(char)
        bodies = {name: _set_body(members) for name, members in classes.items()}
        _LEARNT[key] = Characters(**bodies, bearing=bodies["word"])
    return _LEARNT[key]


def _images(tokenizer: Tokenizer, chars: list[str]) -> list[str]:
    """Each character normalised alone: 256 at a time, joined by a separator
    (a chunk where an image holds the separator is done one at a time)."""
    if tokenizer.normalizer is None:
        return chars
    normalize = tokenizer.normalizer.normalize_str
    separator = normalize(_SEPARATOR)
    if not separator:
        return [normalize(c) for c in chars]
    images: list[str] = []
    for start in range(0, len(chars), 256):
        chunk = chars[start : start + 256]
        parts = normalize(_SEPARATOR.join(chunk)).split(separator)
        images += parts if len(parts) == len(chunk) else [normalize(c) for c in chunk]
    return images


def _splitting(tokenizer: Tokenizer, chars: list[str]) -> tuple[set[str], set[str]]:
    """Of ``chars``, those the pre-tokenizer splits on and drops, and those it
    isolates: each is put between two letters, and one it does not split on
    joins them into one piece."""
    joined = "a" + "a".join(chars) + "a"
    piece_length = [0] * len(joined)  # 0: in no piece
    for _, (start, end) in tokenizer.pre_tokenizer.pre_tokenize_str(joined):
        piece_length[start:end] = [end - start] * (end - start)
    dropped = {c for i, c in enumerate(chars) if piece_length[2 * i + 1] == 0}
    isolated = {c for i, c in enumerate(chars) if piece_length[2 * i + 1] == 1}
    return dropped, isolated


def _assigned(char: str) -> bool:
    """Assigned, in Python's Unicode database, and not private nor a surrogate
    (never in a text decoded from UTF-8): the others stay unclassified."""
    return unicodedata.category(char) not in {"Cn", "Co", "Cs"}


def _set_body(chars: Iterable[str]) -> str:
    """A regex set's body matching ``chars`` (in code point order), less the
    short ranges past the Basic Multilingual Plane."""
    ranges: list[list[int]] = []
    for code in map(ord, chars):
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    return "".join(
        f"\\U{low:08x}-\\U{high:08x}"
        for low, high in ranges
        if high < _PLANE or high - low + 1 >= _SHORTEST_ASTRAL_RANGE
    )


def _kinds(component: dict[str, Any] | None, members: str) -> set[str]:
    if component is None:
        return set()
    if component["type"] == "Sequence":
        return set().union(*(_kinds(c, members) for c in component[members]))
    return {component["type"]}


def _never_tokenless(model: dict[str, Any]) -> bool:
    """Whether every non-empty piece makes at least one token and none fails."""
    if model["type"] == "BPE" and model.get("dropout") is not None:
        return False  # random merges: the same piece need not give the same ids twice
    if model["type"] not in {"WordPiece", "WordLevel", "BPE"}:
        return False
    return model.get("unk_token") in model["vocab"]
