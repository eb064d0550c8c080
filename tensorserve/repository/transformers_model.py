"""A Hugging Face checkpoint served as a batch function
(``platform = "huggingface_transformers"``).

``TransformersModel`` is called as a model.py's forward is, with the padded
``input_ids`` and ``attention_mask`` (the server tokenized each text before
it was queued, or the caller sent ids), and returns the task's output, so
everything around it is the same as for every platform: padding, length-aware
batching, un-padding, warm-up, worker processes, and on CUDA the executor's
pinned copies and two batches in flight.

Loaded from the local folder only (``local_files_only``: nothing is ever
downloaded), from safetensors only (``use_safetensors``: nothing is ever
unpickled), with the checkpoint's own Python run only when the config says
``trust_remote_code = true``. On CUDA the weights become float16 unless
``torch_dtype`` says otherwise, and attention runs through PyTorch's SDPA
kernels where the architecture has them. transformers and
sentence-transformers are an extra (``pip install 'tensorserve[transformers]'``),
imported only here, when such a model loads.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch

from tensorserve.errors import ConfigError
from tensorserve.repository.config import ModelConfig
from tensorserve.repository.transformers_config import (
    TransformersOptions,
    checkpoint_problem,
    sentence_embedding_size,
)

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tensorserve[transformers]'"
# transformers resolves its attributes lazily, and two threads importing
# through it at once may see a half-made module ("no attribute 'AutoModel'"):
# the registry loads models in parallel, so loads take turns here.
_LOADING = threading.Lock()
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def import_transformers(label: str, *, sentence_transformers: bool = False) -> Any:
    try:
        import transformers

        if sentence_transformers:
            import sentence_transformers as library

            return library
    except ImportError:
        raise ConfigError(
            f"{label}: platform 'huggingface_transformers' needs transformers and "
            f"sentence-transformers: {INSTALL_HINT}"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # no bars on the server's stderr
    return transformers


def device_dtype(options: TransformersOptions, device: torch.device) -> torch.dtype:
    """The weights' dtype on ``device``: the config's, else float16 on CUDA
    (half the memory and the tensor cores) and float32 on a CPU."""
    if options.torch_dtype is not None:
        return DTYPES[options.torch_dtype]
    return torch.float16 if device.type == "cuda" else torch.float32


class TransformersModel(torch.nn.Module):
    """The checkpoint's network and what the task makes of its output."""

    def __init__(self, network: torch.nn.Module, options: TransformersOptions, sentence: bool):
        super().__init__()
        self.network = network
        self.options = options
        self.sentence = sentence  # a SentenceTransformer: its own pooling and normalisation

    def to(self, *args: Any, **kwargs: Any) -> TransformersModel:  # type: ignore[override]
        """Moved as ``nn.Module.to`` moves; to a device with no dtype given,
        in the dtype ``torch_dtype`` asks for there (float16 on CUDA)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and dtype is None:
            dtype = device_dtype(self.options, device)
        self.network.to(device=device, dtype=dtype)
        return self

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        task = self.options.task
        if self.sentence:
            features = {"input_ids": input_ids, "attention_mask": attention_mask}
            return {"embedding": self.network(features)["sentence_embedding"].float()}
        out = self.network(input_ids=input_ids, attention_mask=attention_mask)
        if task in ("text-classification", "token-classification"):
            return {"logits": out.logits.float()}
        states = out.last_hidden_state.float()
        if task == "feature-extraction":
            return {"last_hidden_state": states}
        return {"embedding": pool(states, attention_mask, self.options)}


def pool(
    states: torch.Tensor, attention_mask: torch.Tensor, options: TransformersOptions
) -> torch.Tensor:
    """A plain checkpoint's sentence embedding: the mean of the real tokens'
    states (pads excluded) or the first token's, then unit length if asked."""
    if options.pooling == "cls":
        embedding = states[:, 0]
    else:
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        embedding = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if options.normalize:
        embedding = torch.nn.functional.normalize(embedding, p=2, dim=1)
    return embedding


def load_transformers(folder: Path, config: ModelConfig, label: str) -> TransformersModel:
    """The checkpoint in ``folder`` (a version folder), on the CPU in float32;
    ``to(device)`` puts it on its device in its dtype."""
    options = config.transformers
    assert options is not None  # the schema requires [transformers] on this platform
    if options.inputs == "text":  # what runs a batch takes the tokens, never the text
        raise ConfigError(
            f"{label}: its TEXT is tokenized before it is queued, so it is served by "
            f"tensorserve.serving.text.TextServedModel, which loads it with ids inputs"
        )
    problem = checkpoint_problem(folder, options)
    if problem is not None:
        raise ConfigError(f"{label} {problem}")
    common: dict[str, Any] = {
        "local_files_only": True,
        "trust_remote_code": options.trust_remote_code,
    }
    sentence = options.task == "sentence-embedding" and (folder / "modules.json").is_file()
    try:
        with _LOADING:
            if sentence:
                library = import_transformers(label, sentence_transformers=True)
                network = library.SentenceTransformer(str(folder), device="cpu", **common)
                _check_sentence_size(network, folder, label)
            else:
                network = _load_network(import_transformers(label), folder, options, common)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many types
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{label}: transformers cannot load it: {reason}") from None
    network.eval()
    return TransformersModel(network, options, sentence)


def _load_network(
    transformers: Any, folder: Path, options: TransformersOptions, common: dict[str, Any]
) -> torch.nn.Module:
    auto = {
        "sentence-embedding": transformers.AutoModel,
        "feature-extraction": transformers.AutoModel,
        "text-classification": transformers.AutoModelForSequenceClassification,
        "token-classification": transformers.AutoModelForTokenClassification,
    }[options.task]
    kwargs = {**common, "use_safetensors": True, "dtype": torch.float32}
    try:
        network: torch.nn.Module = auto.from_pretrained(
            str(folder), attn_implementation="sdpa", **kwargs
        )
    except ValueError as exc:
        if "sdpa" not in str(exc).lower():
            raise
        # An architecture without SDPA kernels: its own attention, said once.
        log.warning("%s: no SDPA attention for this architecture; eager attention", folder)
        network = auto.from_pretrained(str(folder), attn_implementation="eager", **kwargs)
    return network


def _check_sentence_size(network: Any, folder: Path, label: str) -> None:
    """The embedding size derived from the folder's files (what config.toml
    and metadata show) is the library's own."""
    derived = sentence_embedding_size(folder, label)
    # Renamed in sentence-transformers 6; older releases have only the long name.
    size = getattr(network, "get_embedding_dimension", None)
    actual = size() if size is not None else network.get_sentence_embedding_dimension()
    if actual is not None and derived != actual:
        raise ConfigError(
            f"{label}: the sentence-transformers modules give embeddings of {actual}, "
            f"not the {derived} read from their configs"
        )
