"""Hugging Face checkpoints made here, with seeded random weights and a
WordPiece vocabulary trained on a few sentences: nothing is downloaded.
The tests of ``platform = "huggingface_transformers"`` and its benchmark
serve them.

    write_checkpoint            a BERT-style model and its tokenizer, as
                                ``save_pretrained`` writes them, for one task
    write_sentence_transformer  a sentence-transformers folder (mean pooling,
                                normalised), as ``SentenceTransformer.save``
                                writes it

transformers and sentence-transformers are imported when called (the
server's ``[transformers]`` extra).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _library(name: str) -> Any:
    """An extra's module, typed loosely: its stubs do not cover what is used."""
    return importlib.import_module(name)


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A Triton-style server batches texts of many lengths, pads them and cuts them back.",
    "Hello world, café naïve über: words, numbers 1234 and punctuation!",
    "Tokenizers split text into word pieces; unknown words become [UNK].",
    "Each caller gets its own row, un-padded to its own length.",
] * 8
TASK_CLASSES = {
    "feature-extraction": "BertModel",
    "sentence-embedding": "BertModel",
    "text-classification": "BertForSequenceClassification",
    "token-classification": "BertForTokenClassification",
}


@dataclass(frozen=True)
class Size:
    """A BERT's shape: tiny for tests, larger for the benchmark."""

    hidden: int = 32
    layers: int = 2
    heads: int = 2
    vocab: int = 200
    positions: int = 128
    labels: int = 3


def tokenizer(size: Size, max_length: int, corpus: Sequence[str] = CORPUS) -> Any:
    """A lower-casing WordPiece tokenizer (BERT's pipeline) trained on
    ``corpus``, as ``transformers`` wraps it (``BertTokenizerFast``)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = normalizers.BertNormalizer(lowercase=True)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.train_from_iterator(
        corpus, trainers.WordPieceTrainer(vocab_size=size.vocab, special_tokens=specials)
    )
    cls, sep = raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]")
    raw.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return _library("transformers").BertTokenizerFast(
        tokenizer_object=raw, model_max_length=max_length
    )


def write_checkpoint(
    folder: str | Path,
    task: str,
    size: Size = Size(),
    seed: int = 0,
    max_length: int = 64,
    corpus: Sequence[str] = CORPUS,
) -> Path:
    """``folder`` holding config.json, model.safetensors and the tokenizer's
    files for ``task`` (a feature extractor for both embedding tasks)."""
    import torch

    transformers = _library("transformers")
    folder = Path(folder)
    words = tokenizer(size, max_length, corpus)
    config = transformers.BertConfig(
        vocab_size=len(words),
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=4 * size.hidden,
        max_position_embeddings=size.positions,
        num_labels=size.labels,
        pad_token_id=words.pad_token_id,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, TASK_CLASSES[task])(config)
    model.save_pretrained(folder)
    words.save_pretrained(folder)
    return folder


def write_sentence_transformer(
    folder: str | Path, size: Size = Size(), seed: int = 0, max_length: int = 48
) -> Path:
    """A sentence-transformers folder: the BERT, mean pooling, normalised."""
    import tempfile

    library = _library("sentence_transformers")
    try:  # sentence-transformers 6; older releases have only the old path
        modules = _library("sentence_transformers.sentence_transformer.modules")
    except ImportError:
        modules = _library("sentence_transformers.models")

    folder = Path(folder)
    with tempfile.TemporaryDirectory() as scratch:
        write_checkpoint(scratch, "feature-extraction", size, seed, max_length)
        transformer = modules.Transformer(scratch, max_seq_length=max_length)
        pooling = modules.Pooling(size.hidden, "mean")
        library.SentenceTransformer(modules=[transformer, pooling, modules.Normalize()]).save(
            str(folder)
        )
    return folder
