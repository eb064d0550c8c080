"""``[transformers]``: a Hugging Face checkpoint served with no Python
(``platform = "huggingface_transformers"``), and the inputs and outputs
derived from the checkpoint folder.

The version folder holds what ``save_pretrained`` (or
``SentenceTransformer.save``) writes: ``config.json``, ``model.safetensors``
and the tokenizer's files. Everything here reads JSON only (and the
tokenizer's pad id through ``tokenizers``): no transformers, no torch, so a
config is checked and its tensors derived wherever it is read. The model
itself is loaded by ``transformers_model.py``.

    task                  output (per item)
    sentence-embedding    embedding          float32 [hidden] (or the folder's own size)
    feature-extraction    last_hidden_state  float32 [-1, hidden], un-padded per caller
    text-classification   logits             float32 [num_labels]
    token-classification  logits             float32 [-1, num_labels], un-padded per caller

Inputs: ``TEXT`` (bytes [1], UTF-8), tokenized by the server before the item
is queued; or with ``inputs = "ids"``, ``input_ids`` and ``attention_mask``
(int64 [-1]) as a tokenizer step gives them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tensorserve.errors import ConfigError

Task = Literal[
    "sentence-embedding", "feature-extraction", "text-classification", "token-classification"
]
TRANSFORMERS_PLATFORM = "huggingface_transformers"
TEXT_INPUT = "TEXT"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
# Architectures whose position ids start after the padding index (pad id + 1):
# their max_position_embeddings counts positions no token may use (RoBERTa's
# 514 means 512 tokens).
OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "mpnet", "longformer", "data2vec-text"}
# A tokenizer_config.json with no limit says so with a huge number.
NO_LIMIT = 1 << 30


class TransformersOptions(BaseModel):
    """``[transformers]``: what a ``huggingface_transformers`` model does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: Task = Field(
        description="sentence-embedding | feature-extraction | text-classification | "
        "token-classification: what the checkpoint is loaded as and what it returns."
    )
    pooling: Literal["mean", "cls"] = Field(
        "mean",
        description="sentence-embedding of a plain checkpoint: the mean of the real tokens' "
        "states, or the first token's. A sentence-transformers folder uses its own.",
    )
    normalize: bool = Field(
        False,
        description="sentence-embedding of a plain checkpoint: scale each embedding to unit "
        "length. A sentence-transformers folder uses its own.",
    )
    max_length: int | None = Field(
        None,
        ge=2,
        le=1 << 16,
        description="Tokens per text, special tokens included; longer texts are truncated and "
        "the response's parameters say so. Unset: the smaller of the tokenizer's limit and "
        "the model's usable positions.",
    )
    inputs: Literal["text", "ids"] = Field(
        "text",
        description="text: one TEXT (bytes) input, tokenized by the server before the item is "
        "queued. ids: input_ids and attention_mask, as a tokenizer step gives them.",
    )
    torch_dtype: Literal["float16", "bfloat16", "float32"] | None = Field(
        None,
        description="The weights' dtype on the device. Unset: float16 on CUDA, float32 on a "
        "CPU. Outputs are float32 either way.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the Python a checkpoint ships (config.json's auto_map). Off: such a "
        "checkpoint is refused, and no code from the folder ever runs.",
    )


def _read_json(path: Path, label: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{label}: {path.name} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: {path.name} is not a JSON object")
    return data


def latest_version_folder(model_folder: Path) -> Path | None:
    versions = [p for p in model_folder.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(versions, key=lambda p: int(p.name)) if versions else None


def transformer_folder(folder: Path, label: str) -> Path:
    """Where the transformer's own files are: the version folder, or the
    folder a sentence-transformers ``modules.json`` names for it."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return folder
    try:
        entries = json.loads(modules.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{label}: modules.json is not readable JSON: {exc}") from None
    for entry in entries if isinstance(entries, list) else []:
        if str(entry.get("type", "")).endswith("Transformer"):
            return folder / entry.get("path", "")
    raise ConfigError(f"{label}: modules.json names no Transformer module")


def checkpoint_problem(folder: Path, options: TransformersOptions) -> str | None:
    """Why this folder cannot be served as it stands (None: it can)."""
    inner = transformer_folder(folder, str(folder))
    if not (inner / "config.json").is_file():
        return "holds no config.json (save the checkpoint with save_pretrained)"
    if not any((inner / name).is_file() for name in WEIGHTS):
        pickled = [name for name in PICKLED if (inner / name).is_file()]
        if pickled:
            return (
                f"holds {pickled[0]} but no model.safetensors; tensorserve never unpickles: "
                f"save it with save_pretrained(safe_serialization=True)"
            )
        return "holds no weights (model.safetensors)"
    config = _read_json(inner / "config.json", str(folder))
    if config.get("auto_map") and not options.trust_remote_code:
        return (
            "needs the Python code it ships (config.json has auto_map); set "
            "[transformers] trust_remote_code = true to run it"
        )
    if options.inputs == "text" and not (inner / "tokenizer.json").is_file():
        return "holds no tokenizer.json (a fast tokenizer, as save_pretrained writes it)"
    return None


def derive(model_folder: Path, options: TransformersOptions, label: str) -> dict[str, Any]:
    """The config's inputs and outputs for the checkpoint in the model's
    highest version folder, as config.toml would declare them, and the
    ``max_length`` the server tokenizes to. ``ConfigError`` says why not."""
    folder = latest_version_folder(model_folder)
    if folder is None:
        raise ConfigError(f"{label}: no version folder (e.g. {model_folder.name}/1/config.json)")
    problem = checkpoint_problem(folder, options)
    if problem is not None:
        raise ConfigError(f"{label}: {model_folder.name}/{folder.name} {problem}")
    inner = transformer_folder(folder, label)
    config = _read_json(inner / "config.json", label)
    usable = usable_positions(config)
    limit = min(usable, tokenizer_limit(inner, folder))
    max_length = options.max_length or limit
    if max_length > usable:
        raise ConfigError(
            f"{label}: [transformers] max_length = {max_length} is past the model's "
            f"{usable} usable positions"
        )
    hidden = _first_int(config, ("hidden_size", "d_model", "dim"), label)
    num_labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    task = options.task
    if task == "sentence-embedding":
        size = sentence_embedding_size(folder, label) or hidden
        outputs = [{"name": "embedding", "dtype": "float32", "shape": [size]}]
    elif task == "feature-extraction":
        outputs = [{"name": "last_hidden_state", "dtype": "float32", "shape": [-1, hidden]}]
    elif task == "text-classification":
        outputs = [{"name": "logits", "dtype": "float32", "shape": [num_labels]}]
    else:
        outputs = [{"name": "logits", "dtype": "float32", "shape": [-1, num_labels]}]
    if options.inputs == "text":
        inputs: list[dict[str, Any]] = [
            {"name": TEXT_INPUT, "dtype": "bytes", "shape": [1], "utf8": True}
        ]
    else:
        inputs = ids_inputs(config, pad_id(inner, config), max_length)
    return {"input": inputs, "output": outputs, "max_length": max_length}


def ids_inputs(config: dict[str, Any], pad: int, max_length: int) -> list[dict[str, Any]]:
    """``input_ids`` and ``attention_mask`` as the model takes them: padded
    with the tokenizer's pad id and 0, bounded by the vocabulary."""
    top = int(config.get("vocab_size", 0)) - 1
    ids: dict[str, Any] = {"name": "input_ids", "dtype": "int64", "shape": [-1]}
    ids.update(pad_value=pad, max_length=max_length, min_value=0)
    if top >= 0:
        ids["max_value"] = top
    mask = {"name": "attention_mask", "dtype": "int64", "shape": [-1], "pad_value": 0}
    mask.update(max_length=max_length, min_value=0, max_value=1)
    return [ids, mask]


def usable_positions(config: dict[str, Any]) -> int:
    """Tokens the model can place: ``max_position_embeddings`` less the
    positions its padding offset takes (RoBERTa's 514: 512)."""
    positions = int(config.get("max_position_embeddings") or NO_LIMIT)
    if config.get("model_type") in OFFSET_POSITIONS:
        positions -= int(config.get("pad_token_id") or 1) + 1
    return positions


def tokenizer_limit(inner: Path, folder: Path) -> int:
    """The tokenizer's ``model_max_length`` (a sentence-transformers folder's
    ``max_seq_length`` too, the smaller); no limit when neither says."""
    limits = [NO_LIMIT]
    for path, key in (
        (inner / "tokenizer_config.json", "model_max_length"),
        (folder / "sentence_bert_config.json", "max_seq_length"),
    ):
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if isinstance(value, (int, float)) and 0 < value < NO_LIMIT:
                limits.append(int(value))
    return min(limits)


def pad_id(inner: Path, config: dict[str, Any]) -> int:
    """The tokenizer's pad id (the model config's when the tokenizer has
    none; 0 when neither says)."""
    pad_token = None
    tokenizer_config = inner / "tokenizer_config.json"
    if tokenizer_config.is_file():
        pad_token = json.loads(tokenizer_config.read_text()).get("pad_token")
        if isinstance(pad_token, dict):
            pad_token = pad_token.get("content")
    if isinstance(pad_token, str) and (inner / "tokenizer.json").is_file():
        from tokenizers import Tokenizer  # Rust; no torch

        found = Tokenizer.from_file(str(inner / "tokenizer.json")).token_to_id(pad_token)
        if found is not None:
            return int(found)
    return int(config.get("pad_token_id") or 0)


def sentence_embedding_size(folder: Path, label: str) -> int | None:
    """A sentence-transformers folder's embedding size, from its Pooling
    (times its pooling modes) and Dense modules' configs; None for a plain
    checkpoint. The loader checks it against the library's own."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    size: int | None = None
    for entry in json.loads(modules_file.read_text()):
        kind = str(entry.get("type", ""))
        config_file = folder / entry.get("path", "") / "config.json"
        if kind.endswith("Pooling") and config_file.is_file():
            pooling = json.loads(config_file.read_text())
            width = pooling.get("embedding_dimension", pooling.get("word_embedding_dimension"))
            modes = pooling.get("pooling_mode")
            if isinstance(modes, str):
                count = 1
            elif isinstance(modes, list):
                count = len(modes)
            else:  # older files: one flag per mode
                count = sum(
                    1 for key, on in pooling.items() if key.startswith("pooling_mode_") and on
                )
            size = int(width) * max(1, count)
        elif kind.endswith("Dense") and config_file.is_file():
            size = int(json.loads(config_file.read_text())["out_features"])
    if size is None:
        raise ConfigError(f"{label}: modules.json has no Pooling module to size the embedding")
    return size


def _first_int(config: dict[str, Any], keys: tuple[str, ...], label: str) -> int:
    for key in keys:
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ConfigError(f"{label}: config.json gives no {' or '.join(keys)}")


def same_tensors(declared: list[dict[str, Any]], derived: list[dict[str, Any]]) -> str | None:
    """Why declared ``[[input]]`` or ``[[output]]`` tables do not match the
    checkpoint's (name, dtype and shape, in order), or None."""
    want = [(d["name"], d["dtype"], list(d["shape"])) for d in derived]
    got = [(d.get("name"), d.get("dtype"), list(d.get("shape", []))) for d in declared]
    return None if got == want else f"declares {got} but the checkpoint gives {want}"


def options_of(data: dict[str, Any], label: str) -> TransformersOptions:
    """The ``[transformers]`` table, or ``ConfigError`` naming its bad field."""
    try:
        return TransformersOptions.model_validate(data.get("transformers") or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"transformers.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"{label}: {problems}") from None


def apply_derived(data: dict[str, Any], model_folder: Path, label: str) -> dict[str, Any]:
    """``data`` (a parsed config.toml) with the derived inputs and outputs in
    place. Declared ones are only checked against the checkpoint (one
    sentence when they do not match): the derived ones serve, so the text
    is always checked as UTF-8 and the ids padded with the pad id."""
    derived = derive(model_folder, options_of(data, label), label)
    out = dict(data)
    for kind in ("input", "output"):
        declared = data.get(kind)
        problem = same_tensors(declared, derived[kind]) if declared else None
        if problem is not None:
            raise ConfigError(f"{label}: [[{kind}]] {problem}")
        out[kind] = derived[kind]
    out["transformers"] = {**data["transformers"], "max_length": derived["max_length"]}
    return out
