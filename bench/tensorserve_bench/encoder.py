"""A BERT-base-size encoder, written into a model repository with no download:
a GPU's real work, beside the bundled toys (d_model 128, 2 layers).

    write_encoder(repository)                     # 12 layers, d_model 768, 12 heads,
                                                  # vocab 30,522, max length 512
    write_encoder(repository, EncoderSize(layers=2, d_model=64, heads=2))  # a test's
    python -m tensorserve_bench.encoder REPOSITORY [--layers 2 --d-model 64 --heads 2]

It writes ``bert_encoder`` (token ids and their mask in, one mean-pooled
``embedding`` of d_model floats out) with seeded random weights in
``1/model.safetensors``, and, unless ``text=False``, ``text_bert_encoder``:
strings in, the bundled tokenizer then the encoder (a Triton-style ensemble;
the tokenizer's 4,096 ids are valid ids of a 30,522-id vocabulary). The
tokenizer's folder is copied from the bundled repository when the target has
none. Weights are made here, from ``seed``, every time they are asked for:
never committed, never downloaded (~440 MB in float32 at full size).

The model computes in float16 on CUDA and float32 on the CPU: its ``to``
casts the weights to ``parameters.cuda_dtype`` when they land on a CUDA
device (the server moves a model with ``.to(device)``) and back to float32
elsewhere, so the same folder serves both. Padded keys are masked out of
attention (``attention_mask == 0``) and out of the pooling, so a padded
row's embedding equals the item's run alone within the dtype's rounding.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BUNDLED = ROOT / "model_repository"
MODEL_NAME = "bert_encoder"
TEXT_NAME = "text_bert_encoder"
TOKENIZER = "tokenizer"


@dataclass(frozen=True)
class EncoderSize:
    """The encoder's shape; the defaults are BERT-base's (~110M parameters)."""

    layers: int = 12
    d_model: int = 768
    heads: int = 12
    vocab: int = 30_522
    max_len: int = 512
    d_ff: int | None = None  # default 4 x d_model

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of heads {self.heads}")
        if min(self.layers, self.d_model, self.heads, self.vocab, self.max_len) < 1:
            raise ValueError(f"every size must be at least 1: {self}")

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def parameters(self) -> int:
        """Weights and biases, counted the way ``model.py`` builds them."""
        d, f = self.d_model, self.ff
        layer = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        return self.vocab * d + self.max_len * d + 2 * d + self.layers * layer


BERT_BASE = EncoderSize()

MODEL_PY = '''
"""A BERT-base-shaped encoder (written by tensorserve_bench.encoder).

Embedding(vocab_size, d_model) + learned positions (max_len) -> LayerNorm
-> n_layers post-norm blocks (fused QKV, scaled_dot_product_attention with
the padded keys masked out, GELU feed-forward) -> mean over real tokens.

forward(input_ids [B, T] int64, attention_mask [B, T] int64 (1 = real
token)) -> embedding [B, d_model] float32. On CUDA the weights are
``cuda_dtype`` (float16 by default), on the CPU float32; the pooling sums in
float32 either way. Off the CPU, forward reads no value on the host.
"""

import torch
from torch import nn
from torch.nn import functional as F

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-12)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        # keep: [B, 1, 1, T], True where a key is a real token.
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = self.norm1(x + self.out(attended.transpose(1, 2).reshape(b, t, d)))
        return self.norm2(x + self.ff2(F.gelu(self.ff1(x))))


class Model(nn.Module):
    def __init__(
        self,
        vocab_size: int = 30522,
        d_model: int = 768,
        n_heads: int = 12,
        n_layers: int = 12,
        d_ff: int = 3072,
        max_len: int = 512,
        cuda_dtype: str = "float16",
    ) -> None:
        super().__init__()
        self.max_len = int(max_len)
        self.cuda_dtype = DTYPES[cuda_dtype]
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(max_len, d_model)
        self.embed_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.layers = nn.ModuleList(Block(d_model, n_heads, d_ff) for _ in range(n_layers))

    def to(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        """Moved as asked, then in ``cuda_dtype`` on CUDA and float32 elsewhere."""
        moved = super().to(*args, **kwargs)
        weight = moved.embed.weight
        want = self.cuda_dtype if weight.device.type == "cuda" else torch.float32
        return moved if weight.dtype == want else super(Model, moved).to(dtype=want)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.max_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_len {self.max_len}")
        if attention_mask is None:
            keep = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            keep = attention_mask != 0
            # A row of padding only would make its softmax NaN: keep its first key.
            keep[:, 0] |= ~keep.any(dim=1)
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.embed_norm(self.embed(input_ids) + self.pos_embed(positions)[None, :, :])
        mask = keep[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        weights = keep.to(torch.float32)[..., None]
        return (x.float() * weights).sum(dim=1) / weights.sum(dim=1)
'''

CONFIG = """\
# A BERT-base-size encoder (written by tensorserve_bench.encoder, seed {seed}):
# {parameters:,} parameters, float16 on CUDA, float32 on the CPU. Token ids in,
# one mean-pooled embedding out.
max_batch_size = {max_batch_size}
device = "auto"

[dynamic_batching]
max_queue_delay_ms = 5.0
max_batch_tokens = "auto"    # a CPU learns its budget, a GPU takes full batches

[parameters]
vocab_size = {vocab}
d_model = {d_model}
n_heads = {heads}
n_layers = {layers}
d_ff = {ff}
max_len = {max_len}
cuda_dtype = "float16"

[[input]]
name = "input_ids"
dtype = "int64"
shape = [-1]
pad_value = 0
max_length = {max_len}
min_value = 0
max_value = {max_id}

[[input]]
name = "attention_mask"
dtype = "int64"
shape = [-1]
pad_value = 0
max_length = {max_len}

[[output]]
name = "embedding"
dtype = "float32"
shape = [{d_model}]
"""

TEXT_CONFIG = """\
# Strings in, one embedding out: the bundled tokenizer, then {model}
# (written by tensorserve_bench.encoder).
platform = "ensemble"
max_batch_size = {max_batch_size}

[[input]]
name = "TEXT"
dtype = "bytes"
shape = [1]
utf8 = true

[[output]]
name = "embedding"
dtype = "float32"
shape = [{d_model}]

[[ensemble_scheduling.step]]
model_name = "{tokenizer}"
model_version = -1
input_map = {{ TEXT = "TEXT" }}
output_map = {{ input_ids = "ids", attention_mask = "mask" }}

[[ensemble_scheduling.step]]
model_name = "{model}"
model_version = -1
input_map = {{ input_ids = "ids", attention_mask = "mask" }}
output_map = {{ embedding = "embedding" }}
"""


def write_weights(path: Path, size: EncoderSize, seed: int) -> None:
    """Seeded random weights in BERT's initialisation (normal, std 0.02;
    LayerNorms at one and zero; biases zero), float32, keyed as model.py's."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, 0.02, generator=generator)

    d, f = size.d_model, size.ff
    tensors["embed.weight"] = normal(size.vocab, d)
    tensors["pos_embed.weight"] = normal(size.max_len, d)
    tensors["embed_norm.weight"], tensors["embed_norm.bias"] = torch.ones(d), torch.zeros(d)
    for i in range(size.layers):
        for name, (rows, cols) in {"qkv": (3 * d, d), "out": (d, d), "ff1": (f, d),
                                   "ff2": (d, f)}.items():  # fmt: skip
            tensors[f"layers.{i}.{name}.weight"] = normal(rows, cols)
            tensors[f"layers.{i}.{name}.bias"] = torch.zeros(rows)
        for norm in ("norm1", "norm2"):
            tensors[f"layers.{i}.{norm}.weight"] = torch.ones(d)
            tensors[f"layers.{i}.{norm}.bias"] = torch.zeros(d)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def write_encoder(
    repository: str | Path,
    size: EncoderSize = BERT_BASE,
    *,
    seed: int = 0,
    max_batch_size: int = 64,
    text: bool = True,
    name: str = MODEL_NAME,
    tokenizer_source: str | Path | None = BUNDLED / TOKENIZER,
) -> list[Path]:
    """``repository/name`` (config.toml, 1/model.py, 1/model.safetensors) and,
    with ``text``, ``text_<name>`` over a copy of the bundled tokenizer
    (``tokenizer_source`` None: no copy, the repository it is served beside
    brings its own). Returns the folders written; weights are written again
    every call."""
    repository = Path(repository)
    folder = repository / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(CONFIG.format(
        seed=seed, parameters=size.parameters, max_batch_size=max_batch_size, vocab=size.vocab,
        d_model=size.d_model, heads=size.heads, layers=size.layers, ff=size.ff,
        max_len=size.max_len, max_id=size.vocab - 1))  # fmt: skip
    (folder / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY).lstrip())
    write_weights(folder / "1" / "model.safetensors", size, seed)
    written = [folder]
    if text:
        tokenizer = repository / TOKENIZER
        if tokenizer_source is not None and not tokenizer.exists():
            shutil.copytree(tokenizer_source, tokenizer,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        ensemble = repository / f"text_{name}"
        (ensemble / "1").mkdir(parents=True, exist_ok=True)
        (ensemble / "config.toml").write_text(TEXT_CONFIG.format(
            model=name, tokenizer=TOKENIZER, max_batch_size=max_batch_size,
            d_model=size.d_model))  # fmt: skip
        written += [tokenizer, ensemble] if tokenizer.exists() else [ensemble]
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tensorserve_bench.encoder",
        description="Write a BERT-base-size encoder (seeded random weights) into a repository.",
    )
    parser.add_argument("repository", type=Path)
    parser.add_argument("--layers", type=int, default=BERT_BASE.layers)
    parser.add_argument("--d-model", type=int, default=BERT_BASE.d_model)
    parser.add_argument("--heads", type=int, default=None, help="default d_model / 64, at least 1")
    parser.add_argument("--vocab", type=int, default=BERT_BASE.vocab)
    parser.add_argument("--max-len", type=int, default=BERT_BASE.max_len)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--no-text", action="store_true", help="no text ensemble")
    args = parser.parse_args(argv)
    heads = args.heads or max(1, args.d_model // 64)
    size = EncoderSize(args.layers, args.d_model, heads, args.vocab, args.max_len)
    written = write_encoder(
        args.repository, size, seed=args.seed, max_batch_size=args.max_batch_size,
        text=not args.no_text,
    )  # fmt: skip
    for folder in written:
        print(folder)


if __name__ == "__main__":
    main()
