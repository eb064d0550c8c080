"""tensorserve_bench.encoder: the BERT-base-size encoder, at a reduced size
(2 layers, d_model 64) so that it loads in a second, served by a real server
on loopback. Many callers with different lengths at once, so batches mix
callers and pad: each caller's embedding must equal the item's forward run
alone on the CPU, within the float32 tolerance; the text ensemble must equal
tokenizing then that forward. Padded positions hold ids that would change
the result if the mask were ignored."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.http as triton_http
from tensorserve_bench.encoder import BERT_BASE, EncoderSize, write_encoder, write_weights
from tensorserve_bench.tolerance import tolerance
from tokenizers import Tokenizer

from tests.conftest import ServerProcess

SMALL = EncoderSize(layers=2, d_model=64, heads=2)
CALLERS = 24


def _load(repository: Path, name: str = "bert_encoder") -> Any:
    from tensorserve.repository.loader import discover, load_model, read_config

    source = discover(repository)[name]
    return load_model(source, None, read_config(source, {"device": "cpu"})).module


def _alone(module: Any, ids: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out = module(torch.from_numpy(ids)[None], torch.ones(1, len(ids), dtype=torch.int64))
    return np.asarray(out[0].numpy())


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("encoder_repo")
    write_encoder(repo, SMALL, seed=3, max_batch_size=8)
    return repo


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository)
    yield process
    process.stop()


def test_full_size_is_bert_base() -> None:
    assert (BERT_BASE.layers, BERT_BASE.d_model, BERT_BASE.heads) == (12, 768, 12)
    assert (BERT_BASE.vocab, BERT_BASE.max_len, BERT_BASE.ff) == (30_522, 512, 3072)
    assert 105e6 < BERT_BASE.parameters < 112e6  # BERT-base: ~110M


def test_the_model_has_the_size_asked_and_float32_on_the_cpu(repository: Path) -> None:
    module = _load(repository)
    assert sum(p.numel() for p in module.parameters()) == SMALL.parameters
    assert len(module.layers) == 2 and module.embed.weight.shape == (30_522, 64)
    moved = module.to("cpu")
    assert {p.dtype for p in moved.parameters()} == {torch.float32}


def test_weights_are_seeded(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        write_weights(tmp_path / name / "w.safetensors", SMALL, seed)
    a, b, c = (load_file(str(tmp_path / n / "w.safetensors")) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])


def test_the_mask_hides_padded_positions(repository: Path) -> None:
    module = _load(repository)
    ids = np.arange(5, 17, dtype=np.int64)
    padded = torch.from_numpy(np.concatenate([ids, np.full(7, 999, dtype=np.int64)]))[None]
    mask = torch.tensor([[1] * 12 + [0] * 7])
    with torch.inference_mode():
        masked, unmasked = module(padded, mask), module(padded, torch.ones_like(mask))
    alone = _alone(module, ids)
    assert np.abs(masked[0].numpy() - alone).max() <= tolerance("float32", 1.0)
    assert np.abs(unmasked[0].numpy() - alone).max() > 1e-3  # the padding would show


def test_served_rows_equal_per_item_forwards(repository: Path, server: ServerProcess) -> None:
    module = _load(repository)
    rng = np.random.default_rng(0)
    items = [rng.integers(1, 30_522, int(n)).astype(np.int64) for n in rng.integers(2, 60, CALLERS)]
    address = server.url.removeprefix("http://")

    def call(ids: np.ndarray) -> np.ndarray:
        client = triton_http.InferenceServerClient(address)
        try:
            inputs = [triton_http.InferInput(n, [1, len(ids)], "INT64")
                      for n in ("input_ids", "attention_mask")]  # fmt: skip
            inputs[0].set_data_from_numpy(ids[None])
            inputs[1].set_data_from_numpy(np.ones((1, len(ids)), dtype=np.int64))
            return np.asarray(client.infer("bert_encoder", inputs).as_numpy("embedding"))
        finally:
            client.close()

    with ThreadPoolExecutor(CALLERS) as pool:  # all at once: batches mix callers and pad
        got = list(pool.map(call, items))
    for ids, row in zip(items, got, strict=True):
        want = _alone(module, ids)
        assert row.shape == (1, 64)
        assert np.abs(row[0] - want).max() <= tolerance("float32", float(np.abs(want).max()))
    # Different items give different rows: a caller handed a neighbour's row would show.
    assert min(np.abs(got[0] - g).max() for g in got[1:]) > 1e-3


def test_text_ensemble_equals_tokenizing_then_the_encoder(
    repository: Path, server: ServerProcess
) -> None:
    module = _load(repository)
    tokenizer = Tokenizer.from_file(str(repository / "tokenizer" / "1" / "tokenizer.json"))
    texts = ["Hello world", "The tagger reads a sentence and gives each token nine scores.",
             "zebras", "A much longer sentence, with several clauses and commas."]  # fmt: skip
    address = server.url.removeprefix("http://")

    def call(text: str) -> np.ndarray:
        client = triton_http.InferenceServerClient(address)
        try:
            tensor = triton_http.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[text]], dtype=object))
            return np.asarray(client.infer("text_bert_encoder", [tensor]).as_numpy("embedding"))
        finally:
            client.close()

    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(call, texts))
    for text, row in zip(texts, got, strict=True):
        want = _alone(module, np.array(tokenizer.encode(text).ids, dtype=np.int64))
        assert np.abs(row[0] - want).max() <= tolerance("float32", float(np.abs(want).max())), text


def test_the_command_writes_a_model_of_the_size_asked(tmp_path: Path) -> None:
    from tensorserve_bench.encoder import main

    main([str(tmp_path), "--layers", "1", "--d-model", "32", "--no-text"])
    module = _load(tmp_path)
    assert len(module.layers) == 1 and module.embed.weight.shape == (30_522, 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert_encoder"]  # no text ensemble
    assert 'cuda_dtype = "float16"' in (tmp_path / "bert_encoder" / "config.toml").read_text()
