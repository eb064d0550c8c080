#!/usr/bin/env python3
"""Deterministically (re)generate the weights of the bundled example models.

For every model directory ``<repo>/<model>/`` that has ``config.toml`` and
``1/model.py``, this builds ``Model(**parameters)`` from that model's own
``model.py`` (``parameters`` = the config's ``[parameters]`` table) after
``torch.manual_seed(seed)``, and writes ``1/model.safetensors`` (fp32) with
``safetensors.torch.save_file``.  Running it twice yields byte-identical files.

The ``tokenizer`` has no weights: its ``1/tokenizer.json`` (a WordPiece
vocabulary of at most 4096 entries, the tagger's, with ``[PAD]`` = 0, for
the Hugging Face ``tokenizers`` library) is learnt from
``scripts/data/tokenizer_corpus.txt``, a small corpus kept in the repository
(nothing is downloaded); the same corpus gives the same file.

It also exports ``examples/model_repository/tagger_onnx/1/model.onnx`` (an
example beside the default repository: serving it needs the ``onnx`` extra):
the tagger's own weights (the same seed) as an ONNX graph with dynamic batch and token axes, through
``torch.onnx.export(dynamo=True)``, which needs ``onnxscript``
(``pip install onnxscript``); without it that model is skipped, saying so.

And it copies the tagger's weights to
``examples/model_repository/packed_tagger/1/model.safetensors``: the packed
tagger has the tagger's modules under the same names (only its forward
differs), so the same file serves both.

Usage::

    python scripts/generate_example_weights.py                 # all bundled models
    python scripts/generate_example_weights.py tagger embedder # selected models
    python scripts/generate_example_weights.py --repo /tmp/repo --seed 0
    python scripts/generate_example_weights.py tagger_onnx     # the ONNX export only
    python scripts/generate_example_weights.py packed_tagger   # the weights' copy only

Reusable from Python (e.g. benchmarks building a bigger variant)::

    from generate_example_weights import make_variant, write_weights
    make_variant(Path("model_repository/tagger"), tmp / "tagger",
                 {"vocab_size": 30000})      # copy + rewrite [parameters] + weights
    write_weights(model_dir, {"vocab_size": 30000})  # weights only
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# Models that need an extra to serve (tagger_onnx: onnxruntime), kept out of the
# default repository so that a plain install serves every model of it.
EXAMPLES_REPOSITORY = REPO_ROOT / "examples" / "model_repository"
VERSION = "1"
CORPUS = REPO_ROOT / "scripts" / "data" / "tokenizer_corpus.txt"
# Models whose version folder holds a trained tokenizer.json instead of weights.
TOKENIZERS = {"tokenizer"}
# The tokenizer's special tokens: [PAD] is 0, the tagger's and embedder's pad_value.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def read_parameters(model_dir: Path) -> dict[str, Any]:
    """Return the ``[parameters]`` table of ``model_dir/config.toml`` ({} if absent)."""
    with open(Path(model_dir) / "config.toml", "rb") as f:
        config = tomllib.load(f)
    return dict(config.get("parameters", {}))


def load_model_class(model_py: Path) -> type[torch.nn.Module]:
    """Import ``model_py`` under a unique module name and return its ``Model`` class."""
    name = f"_example_model_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, model_py)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {model_py}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Model


def build_model(
    model_dir: Path, parameters_override: dict[str, Any] | None = None, seed: int = 0
) -> torch.nn.Module:
    """Construct the model of ``model_dir`` with seeded random init (fp32, eval mode)."""
    model_dir = Path(model_dir)
    parameters = read_parameters(model_dir)
    parameters.update(parameters_override or {})
    model_cls = load_model_class(model_dir / VERSION / "model.py")
    torch.manual_seed(seed)
    model = model_cls(**parameters)
    return model.float().eval()


def _state_dict_for_safetensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Contiguous, unshared CPU fp32 copies: save_file refuses tensors that share
    # storage (tied weights) and non-contiguous tensors.
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(torch.float32)
        out[key] = t.contiguous().clone()
    return out


def write_weights(
    model_dir: Path, parameters_override: dict[str, Any] | None = None, seed: int = 0
) -> Path:
    """Write ``model_dir/1/model.safetensors`` for the model in ``model_dir``.

    ``parameters_override`` is merged over the config's ``[parameters]`` table
    when constructing the model.  It does NOT edit ``config.toml``; if the
    server must load the result, the config has to carry the same parameters
    (use :func:`make_variant` to do both).  Returns the written path.
    """
    model = build_model(model_dir, parameters_override, seed)
    path = Path(model_dir) / VERSION / "model.safetensors"
    tmp = path.with_suffix(".safetensors.tmp")
    save_file(_state_dict_for_safetensors(model), str(tmp))
    tmp.replace(path)
    return path


def learn_vocabulary(words: Counter[str], vocab_size: int) -> list[str]:
    """A WordPiece vocabulary from word counts, deterministically (the
    library's own trainer breaks ties differently from run to run): the
    special tokens, every character (alone and as a ``##`` continuation),
    then whole words and the ``##`` endings of 2-4 characters that at least
    three words share, most frequent first, ties in alphabetical order."""
    chars = sorted({c for word in words for c in word})
    pieces: Counter[str] = Counter()
    for word, count in words.items():
        for size in range(2, 5):
            if len(word) > size:
                pieces["##" + word[-size:]] += count
    ranked = [(-n, w) for w, n in words.items() if len(w) > 1]
    ranked += [(-n, p) for p, n in pieces.items() if n >= 3]
    vocabulary = [*SPECIAL_TOKENS, *chars, *("##" + c for c in chars)]
    vocabulary += [token for _, token in sorted(ranked)][: vocab_size - len(vocabulary)]
    return vocabulary


def write_tokenizer(
    model_dir: Path, corpus: Path = CORPUS, vocab_size: int = 4096, max_length: int = 512
) -> Path:
    """Learn a WordPiece vocabulary from ``corpus`` (lower-cased, split by
    BERT's pre-tokenizer, the ``tokenizers`` library's own) and write
    ``model_dir/1/tokenizer.json``: ``[CLS] text [SEP]``, truncated at
    ``max_length`` tokens. The same corpus gives the same file."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words: Counter[str] = Counter()
    for line in Path(corpus).read_text(encoding="utf-8").splitlines():
        words.update(w for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line)))
    vocabulary = learn_vocabulary(words, vocab_size)
    tokenizer = Tokenizer(
        models.WordPiece({t: i for i, t in enumerate(vocabulary)}, unk_token="[UNK]")
    )
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, splitter
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[(t, vocabulary.index(t)) for t in ("[CLS]", "[SEP]")],
    )
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.enable_truncation(max_length)
    path = Path(model_dir) / VERSION / "tokenizer.json"
    path.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"unsupported [parameters] value type: {type(value).__name__}")


def set_config_parameters(config_path: Path, updates: dict[str, Any]) -> None:
    """Rewrite/add ``key = value`` lines in the ``[parameters]`` table of a config.

    Supports scalar values (int, float, bool, str).  Adds a ``[parameters]``
    table if the config has none.  The result is re-parsed to check it.
    """
    config_path = Path(config_path)
    lines = config_path.read_text().splitlines()
    header = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    start = end = None
    for i, line in enumerate(lines):
        m = header.match(line)
        if m is None:
            continue
        if start is not None and end is None:
            end = i
        if m.group(1) == "parameters" and not line.lstrip().startswith("[["):
            start = i
    if start is None:
        lines += ["", "[parameters]"]
        start, end = len(lines) - 1, len(lines)
    elif end is None:
        end = len(lines)
    remaining = dict(updates)
    for i in range(start + 1, end):
        m = re.match(r"^(\s*)([A-Za-z0-9_-]+)(\s*=\s*)", lines[i])
        if m and m.group(2) in remaining:
            value = _toml_value(remaining.pop(m.group(2)))
            lines[i] = f"{m.group(1)}{m.group(2)}{m.group(3)}{value}"
    # Insert new keys right after the last non-blank line of the table.
    insert_at = end
    while insert_at > start + 1 and not lines[insert_at - 1].strip():
        insert_at -= 1
    new_lines = [f"{k} = {_toml_value(v)}" for k, v in remaining.items()]
    lines[insert_at:insert_at] = new_lines
    text = "\n".join(lines) + "\n"
    parsed = tomllib.loads(text).get("parameters", {})
    for k, v in updates.items():
        if parsed.get(k) != v:
            raise RuntimeError(f"failed to set parameters.{k} in {config_path}")
    config_path.write_text(text)


def make_variant(
    src_dir: Path,
    dst_dir: Path,
    parameters_override: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Copy model dir ``src_dir`` to ``dst_dir``, apply ``parameters_override`` to
    its config's ``[parameters]`` table, and write matching weights.

    A new ``vocab_size`` moves the inputs' ``max_value`` (the last id) with it;
    output shapes in the config that depend on a parameter (e.g. the
    embedder's ``shape = [64]`` = d_model) are not rewritten.
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    shutil.copytree(
        src_dir,
        dst_dir,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.safetensors*"),
        dirs_exist_ok=True,
    )
    if parameters_override:
        vocab_before = read_parameters(dst_dir).get("vocab_size")
        set_config_parameters(dst_dir / "config.toml", parameters_override)
        vocab = parameters_override.get("vocab_size")
        if vocab is not None and vocab_before is not None:
            set_id_bounds(dst_dir / "config.toml", vocab_before - 1, vocab - 1)
    write_weights(dst_dir, None, seed)
    return dst_dir


def set_id_bounds(config_path: Path, old: int, new: int) -> None:
    """Rewrite the inputs' ``max_value = old`` lines (the last id of the old
    vocabulary) to ``new``: ids of a variant with a bigger vocabulary would
    otherwise be refused by its config."""
    config_path = Path(config_path)
    pattern = re.compile(rf"^(\s*max_value\s*=\s*){old}(?![0-9])", re.MULTILINE)
    text = pattern.sub(lambda m: f"{m.group(1)}{new}", config_path.read_text())
    if any(i.get("max_value") == old for i in tomllib.loads(text).get("input", [])):
        raise RuntimeError(f"failed to set max_value = {new} in {config_path}")
    config_path.write_text(text)


class ExportableTagger(torch.nn.Module):
    """The tagger's forward without its data-dependent branches, for export:
    an exporter follows one path of an ``if`` on tensor values, so the mask
    is always applied (a graph traced with no padding would drop it)."""

    def __init__(self, tagger: torch.nn.Module) -> None:
        super().__init__()
        self.tagger = tagger

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = self.tagger
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = t.embed(input_ids) + t.pos_embed(positions)[None, :, :]
        return t.head(t.encoder(x, src_key_padding_mask=attention_mask == 0))


def export_tagger_onnx(repository: Path, examples: Path, seed: int = 0) -> Path:
    """Write ``<examples>/tagger_onnx/1/model.onnx`` from ``<repository>/tagger``'s
    model.py and seed: dynamic ``batch`` and ``tokens`` axes, the mask an input."""
    import warnings

    model = ExportableTagger(build_model(Path(repository) / "tagger", seed=seed)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 0, 0, 0]])
    batch, tokens = torch.export.Dim("batch", max=4096), torch.export.Dim("tokens", max=512)
    path = Path(examples) / "tagger_onnx" / VERSION / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on torchvision and the like
        torch.onnx.export(
            model, (ids, (ids != 0).long()), str(path),
            input_names=["input_ids", "attention_mask"], output_names=["logits"],
            dynamic_shapes={"input_ids": {0: batch, 1: tokens},
                            "attention_mask": {0: batch, 1: tokens}},
            dynamo=True, external_data=False, verbose=False,
        )  # fmt: skip
    return path


def copy_packed_tagger_weights(repository: Path, examples: Path) -> Path:
    """``<examples>/packed_tagger/1/model.safetensors``: the tagger's own file."""
    path = Path(examples) / "packed_tagger" / VERSION / "model.safetensors"
    shutil.copyfile(Path(repository) / "tagger" / VERSION / "model.safetensors", path)
    return path


def model_dirs(repository: Path) -> list[Path]:
    return sorted(
        p
        for p in Path(repository).iterdir()
        if (p / "config.toml").is_file() and (p / VERSION / "model.py").is_file()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="model names (default: all)")
    parser.add_argument("--repo", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--examples", type=Path, default=EXAMPLES_REPOSITORY,
                        help="where tagger_onnx lives (default: examples/model_repository)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    dirs = model_dirs(args.repo)
    export_onnx = (args.examples / "tagger_onnx").is_dir() and (
        not args.models or "tagger_onnx" in args.models
    )
    copy_packed = (args.examples / "packed_tagger").is_dir() and (
        not args.models or "packed_tagger" in args.models
    )
    asked = [m for m in args.models if m not in ("tagger_onnx", "packed_tagger")]
    if args.models and not asked:
        dirs = []  # only the ONNX export was asked for
    elif asked:
        by_name = {d.name: d for d in dirs}
        missing = [m for m in asked if m not in by_name]
        if missing:
            parser.error(f"unknown model(s) in {args.repo}: {', '.join(missing)}")
        dirs = [by_name[m] for m in asked]
    for d in dirs:
        if d.name in TOKENIZERS:
            path = write_tokenizer(d)
        else:
            path = write_weights(d, seed=args.seed)
        print(f"{d.name}: {path.relative_to(args.repo)} ({path.stat().st_size} bytes)")
    if copy_packed:
        path = copy_packed_tagger_weights(args.repo, args.examples)
        print(f"packed_tagger: {path} (the tagger's weights)")
    if export_onnx:
        try:
            import onnxscript  # noqa: F401  (torch.onnx's exporter)
        except ImportError:
            print("tagger_onnx: skipped: the ONNX export needs onnxscript (pip install onnxscript)")
            return 0
        path = export_tagger_onnx(args.repo, args.examples, seed=args.seed)
        print(f"tagger_onnx: {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
