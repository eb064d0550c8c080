"""``TextServedModel``: a Hugging Face checkpoint whose input is text
(``platform = "huggingface_transformers"``, ``[transformers] inputs = "text"``).

    caller's TEXT ─▶ validate (UTF-8, size) ─▶ tokenize on the request pool
    (one encode_batch for the request, each text bounded by the cut rule)
    ─▶ input_ids + attention_mask queued ─▶ batch (padded with the pad id)
    ─▶ forward ─▶ un-pad ─▶ each caller's row, with ``truncated`` in its
    response parameters

Two configs, one model. ``config`` is what callers see (metadata, the
config endpoint, the front ends' validation): a TEXT input and the task's
outputs. The batcher, the collator and the instances (worker processes too)
run ``tokenized``: the same model with ``input_ids`` and ``attention_mask``
in place of TEXT, so length-aware batching counts real tokens and per-token
outputs are un-padded like the ids. Tokenizing happens before admission,
never on the event loop and never in a batch: a text that cannot be read is
its caller's 400, and one long text never holds up a batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.pools import on_request_pool
from tensorserve.repository.config import ModelConfig
from tensorserve.repository.loader import ModelSource, resolve_version
from tensorserve.repository.transformers_config import (
    TEXT_INPUT,
    ids_inputs,
    pad_id,
    transformer_folder,
)
from tensorserve.serving.model import Item, Result, ServedModel
from tensorserve.settings import DEFAULT_BYTES_LIMITS, BytesLimits
from tensorserve.tensors.results import RowResult, row_parameters
from tensorserve.text.encoder import EncodedText, TextEncoder

TRUNCATED = "truncated"  # the response parameter: the text had more tokens than max_length


def tokenized_config(config: ModelConfig, source: ModelSource, version: int) -> ModelConfig:
    """``config`` with ``input_ids`` and ``attention_mask`` (padded with the
    tokenizer's pad id) in place of TEXT: what the batcher and the model run."""
    assert config.transformers is not None and config.transformers.max_length is not None
    inner = transformer_folder(source.path / str(version), source.name)
    checkpoint = json.loads((inner / "config.json").read_text())
    inputs = ids_inputs(checkpoint, pad_id(inner, checkpoint), config.transformers.max_length)
    data = config.model_dump()
    data["input"] = inputs
    data["transformers"] = {**data["transformers"], "inputs": "ids"}
    return ModelConfig.model_validate(data)


class TextServedModel(ServedModel):
    """A ``ServedModel`` that tokenizes each text before it is queued."""

    tokenized: ModelConfig  # what the batcher runs ("auto" resolved)
    encoder: TextEncoder

    @classmethod
    def from_source(
        cls,
        source: ModelSource,
        version: int | None,
        config: ModelConfig,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        intra_op_threads: int | None = None,
    ) -> TextServedModel:
        # derived at load (repository/transformers_config.py): never unset here
        assert config.transformers is not None and config.transformers.max_length is not None
        version = resolve_version(source, version)
        inner = transformer_folder(source.path / str(version), source.name)
        encoder = TextEncoder.from_file(
            str(inner / "tokenizer.json"), config.transformers.max_length
        )
        tokenized = tokenized_config(config, source, version)
        served = cast(
            TextServedModel,
            super().from_source(
                source, version, tokenized, on_fatal=on_fatal, intra_op_threads=intra_op_threads
            ),
        )
        served.tokenized = served.config
        served.config = _public(served.config, config)
        served.encoder = encoder
        return served

    # ---------------------------------------------------------------- inference
    def tokenize(self, rows: Sequence[Mapping[str, np.ndarray]]) -> list[EncodedText]:
        """Each validated item's text (UTF-8 already checked) as its tokens."""
        texts = [bytes(row[TEXT_INPUT].reshape(-1)[0]).decode("utf-8") for row in rows]
        return self.encoder.encode(texts)

    def submit_many(self, items: Sequence[Item], **kwargs: Any) -> list[Any]:
        raise InvalidInput(
            f"model {self.name!r} tokenizes its text before queueing: use infer_many "
            f"(or infer_many_sync)"
        )

    async def infer_many(
        self,
        items: Sequence[Item],
        *,
        timeout: float | None = None,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
        bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
    ) -> list[Result]:
        level, values = self.priority_level(priority), self.request_parameters(parameters)
        rows = self.validate(items, bytes_limits)
        return await self.infer_validated(rows, timeout=timeout, level=level, values=values)

    async def infer_validated(
        self,
        rows: Sequence[Mapping[str, np.ndarray]],
        *,
        timeout: float | None,
        level: int,
        values: Mapping[str, Any],
    ) -> list[Result]:
        """Rows already validated (by this process, or a front end): tokenized
        on the request pool, then queued. The deadline counts the tokenizing."""
        started = time.monotonic()
        encoded = await on_request_pool(self.tokenize, rows)
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - started))
        items = [{"input_ids": e.input_ids, "attention_mask": e.attention_mask} for e in encoded]
        results = await self.batcher.infer_many(
            items, timeout=timeout, priority=level, parameters=values
        )
        return _with_truncation(results, encoded)

    def infer_many_sync(
        self,
        items: Sequence[Item],
        *,
        timeout: float | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> list[Result]:
        level, values = self.priority_level(None), self.request_parameters(parameters)
        encoded = self.tokenize(self.validate(items))
        tokens = [{"input_ids": e.input_ids, "attention_mask": e.attention_mask} for e in encoded]
        futures = self.batcher.submit_many(
            tokens, timeout=timeout, priority=level, parameters=values
        )
        try:
            return _with_truncation([f.result(timeout) for f in futures], encoded)
        finally:
            for f in futures:
                f.cancel()

    def warmup_items(self, config: ModelConfig | None = None) -> list[list[dict[str, np.ndarray]]]:
        """The grid of the tokenized model: ids of the warm-up lengths."""
        return super().warmup_items(config or self.tokenized)

    def warm(self, batch: list[dict[str, np.ndarray]]) -> None:
        """Token ids already: straight to the batcher."""
        for future in self.batcher.submit_many(batch, timeout=600):
            future.result(600)


def _with_truncation(results: Sequence[Result], encoded: Sequence[EncodedText]) -> list[Result]:
    """Each caller's result with ``truncated`` among its output parameters."""
    return [
        RowResult(result, {**row_parameters(result), TRUNCATED: e.truncated})
        for result, e in zip(results, encoded, strict=True)
    ]


def _public(tokenized: ModelConfig, declared: ModelConfig) -> ModelConfig:
    """What callers see: the resolved config with the declared TEXT input."""
    data = tokenized.model_dump()
    data["input"] = [s.model_dump() for s in declared.input]
    data["transformers"] = {**data["transformers"], "inputs": "text"}
    return ModelConfig.model_validate(data)
