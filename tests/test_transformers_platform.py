"""A Hugging Face checkpoint served with no Python (issue #53):
``platform = "huggingface_transformers"`` and a ``[transformers]`` table.

Tiny checkpoints (hidden 32, 2 layers, a WordPiece vocabulary of 200) are
written here by ``save_pretrained`` and ``SentenceTransformer.save`` with
seeded random weights. A real server on loopback serves the four tasks; 64
callers at once, with texts of mixed lengths, over msgpack, KServe JSON
(tritonclient.http) and gRPC (tritonclient.grpc), each get their own row,
equal within 1e-5 to the library run on their text alone in this process:
``SentenceTransformer.encode`` for the sentence-transformers folder, the
model's forward on one tokenized text for the others. Every task runs both
in a worker process (``isolation = "process"``) and in a thread; a second
server with ``--frontends 2`` tokenizes in the scheduler process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")
import torch  # noqa: E402
import tritonclient.grpc as triton_grpc  # noqa: E402
import tritonclient.http as triton_http  # noqa: E402
from tensorserve_bench.checkpoints import write_checkpoint, write_sentence_transformer  # noqa: E402
from tensorserve_bench.server import ServerProcess  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tensorserve.errors import ConfigError  # noqa: E402
from tensorserve.repository.loader import discover, load_model, read_config  # noqa: E402
from tensorserve.repository.transformers_config import (  # noqa: E402
    TransformersOptions,
    usable_positions,
)
from tensorserve.repository.transformers_model import device_dtype  # noqa: E402
from tensorserve.serving.text import TextServedModel  # noqa: E402
from tensorserve.text.encoder import TextEncoder  # noqa: E402
from tests.helpers import MSGPACK  # noqa: E402

MAX_LENGTH = 24  # short enough that the long texts below are truncated
TOLERANCE = 1e-5
CALLERS = 64
WORDS = "the quick brown fox jumps over lazy dog hello world café naïve batches texts".split()
# name: (task, isolation, extra [transformers] lines)
MODELS = {
    "st_embedder": ("sentence-embedding", "process", ""),
    "features": ("feature-extraction", "process", ""),
    "classifier": ("text-classification", "thread", ""),
    "tagger": ("token-classification", "thread", ""),
    "cls_embedder": ("sentence-embedding", "thread", 'pooling = "cls"\nnormalize = true'),
    # The same checkpoints in the other isolation: every task in both.
    "st_embedder_thread": ("sentence-embedding", "thread", ""),
    "features_thread": ("feature-extraction", "thread", ""),
    "classifier_process": ("text-classification", "process", ""),
    "tagger_process": ("token-classification", "process", ""),
}
TWIN_OF = {
    "st_embedder_thread": "st_embedder",
    "features_thread": "features",
    "classifier_process": "classifier",
    "tagger_process": "tagger",
}
OUTPUT = {
    "sentence-embedding": "embedding",
    "feature-extraction": "last_hidden_state",
    "text-classification": "logits",
    "token-classification": "logits",
}


def _texts(count: int, seed: int) -> list[str]:
    """Texts of 0 to 40 words: some empty, most short, some truncated."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(0, 40)))) for _ in range(count)]


def _config(task: str, isolation: str, extra: str) -> str:
    return (
        f'platform = "huggingface_transformers"\nmax_batch_size = 16\nisolation = "{isolation}"\n'
        f"[dynamic_batching]\nmax_queue_delay_ms = 5.0\n"
        f"[faults]\nstandby_worker = false\n"
        f"[warmup]\nlengths = [8]\n"
        f'[transformers]\ntask = "{task}"\nmax_length = {MAX_LENGTH}\n{extra}\n'
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("hf_repository")
    for seed, (name, (task, isolation, extra)) in enumerate(MODELS.items()):
        folder = repo / name / "1"
        if name in TWIN_OF:
            shutil.copytree(repo / TWIN_OF[name] / "1", folder)
        elif name == "st_embedder":
            write_sentence_transformer(folder, seed=seed, max_length=MAX_LENGTH)
        else:
            write_checkpoint(folder, task, seed=seed)
        (repo / name / "config.toml").write_text(_config(task, isolation, extra))
    # The tagger's checkpoint again, taking token ids (as an ensemble's tokenizer step gives them).
    shutil.copytree(repo / "tagger", repo / "tagger_ids")
    config = _config("token-classification", "thread", 'inputs = "ids"')
    (repo / "tagger_ids" / "config.toml").write_text(config)
    return repo


class Reference:
    """Each model as the library runs it, one text at a time, in this process."""

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        self.tokenizers: dict[str, Any] = {}
        self.models: dict[str, Any] = {}

    def tokens(self, name: str, text: str) -> int:
        """The text's tokens, untruncated, by the model's own tokenizer (each
        checkpoint trained its own vocabulary)."""
        name = TWIN_OF.get(name, name)
        self(name, "")
        if name == "st_embedder":
            return len(self.models[name].tokenizer(text).input_ids)
        return len(self.tokenizers[name](text).input_ids)

    def __call__(self, name: str, text: str) -> np.ndarray:
        name = TWIN_OF.get(name, name)
        task, _, _ = MODELS[name]
        folder = str(self.repository / name / "1")
        if name == "st_embedder":
            if name not in self.models:
                self.models[name] = sentence_transformers.SentenceTransformer(folder, device="cpu")
            return np.asarray(self.models[name].encode(text))
        if name not in self.models:
            auto = {
                "text-classification": transformers.AutoModelForSequenceClassification,
                "token-classification": transformers.AutoModelForTokenClassification,
            }.get(task, transformers.AutoModel)
            self.models[name] = auto.from_pretrained(folder).eval()
            self.tokenizers[name] = transformers.AutoTokenizer.from_pretrained(folder)
        tokens = self.tokenizers[name](
            text, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
        )
        with torch.inference_mode():
            out = self.models[name](**tokens)
        if task in ("text-classification", "token-classification"):
            return out.logits[0].numpy()
        states = out.last_hidden_state[0]
        if task == "feature-extraction":
            return states.numpy()
        return torch.nn.functional.normalize(states[0], dim=0).numpy()  # cls, normalised


@pytest.fixture(scope="module")
def reference(repository: Path) -> Reference:
    return Reference(repository)


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(str(repository), ready_timeout=150).start()
    yield process
    process.stop()


def _calls(seed: int, names: list[str] = list(MODELS)) -> list[tuple[str, str]]:
    return [(names[i % len(names)], text) for i, text in enumerate(_texts(CALLERS, seed))]


def _msgpack_call(url: str, name: str, text: str) -> tuple[np.ndarray, dict[str, Any]]:
    body = {"items": [{"TEXT": {"dtype": "bytes", "shape": [1], "data": [text.encode()]}}]}
    reply = httpx.post(
        f"{url}/v2/models/{name}/infer", content=msgpack.packb(body), headers=MSGPACK, timeout=120
    )
    assert reply.status_code == 200, reply.content[:300]
    decoded = msgpack.unpackb(reply.content)
    tensor = decoded["outputs"][0][OUTPUT[MODELS[name][0]]]
    array = np.frombuffer(tensor["data"], dtype=tensor["dtype"]).reshape(tensor["shape"])
    return array, decoded["parameters"][0]


def _triton_input(module: Any, text: str) -> Any:
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    return tensor


def _kserve_call(url: str, name: str, text: str) -> tuple[np.ndarray, dict[str, Any]]:
    client = triton_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=120)
    try:
        result = client.infer(name, [_triton_input(triton_http, text)])
    finally:
        client.close()
    parameters = result.get_response()["parameters"]
    return result.as_numpy(OUTPUT[MODELS[name][0]])[0], {"truncated": parameters["truncated"][0]}


def _grpc_call(client: Any, name: str, text: str) -> tuple[np.ndarray, dict[str, Any]]:
    result = client.infer(name, [_triton_input(triton_grpc, text)], client_timeout=120)
    truncated = json.loads(result.get_response().parameters["truncated"].string_param)
    return result.as_numpy(OUTPUT[MODELS[name][0]])[0], {"truncated": truncated[0]}


def _check_all(call: Any, reference: Reference, seed: int, names: list[str] = list(MODELS)) -> None:
    calls = _calls(seed, names)
    with ThreadPoolExecutor(CALLERS) as pool:
        got = list(pool.map(lambda c: call(*c), calls))
    truncated = 0
    for (name, text), (array, parameters) in zip(calls, got, strict=True):
        expected = reference(name, text)
        assert array.shape == expected.shape, (name, text)  # un-padded to its own tokens
        np.testing.assert_allclose(array, expected, rtol=0, atol=TOLERANCE, err_msg=name)
        assert parameters["truncated"] is (reference.tokens(name, text) > MAX_LENGTH), (name, text)
        truncated += parameters["truncated"]
    assert 0 < truncated < len(calls)  # both kinds were asked


def test_64_callers_over_msgpack_get_the_librarys_rows(
    server: ServerProcess, reference: Reference
) -> None:
    _check_all(lambda name, text: _msgpack_call(server.url, name, text), reference, seed=1)


def test_64_callers_over_kserve_json_get_the_librarys_rows(
    server: ServerProcess, reference: Reference
) -> None:
    _check_all(lambda name, text: _kserve_call(server.url, name, text), reference, seed=2)


def test_64_callers_over_grpc_get_the_librarys_rows(
    server: ServerProcess, reference: Reference
) -> None:
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        _check_all(lambda name, text: _grpc_call(client, name, text), reference, seed=3)
    finally:
        client.close()


def test_token_ids_in_are_padded_with_the_pad_id_and_cut_back_per_caller(
    server: ServerProcess, reference: Reference
) -> None:
    texts = _texts(16, seed=5)
    reference("tagger", "")  # loads its model and tokenizer
    tokenizer = reference.tokenizers["tagger"]
    items = []
    for text in texts:
        ids = np.asarray(tokenizer(text, truncation=True, max_length=MAX_LENGTH).input_ids)
        items.append({"input_ids": _wire(ids), "attention_mask": _wire(np.ones_like(ids))})
    reply = httpx.post(
        f"{server.url}/v2/models/tagger_ids/infer",
        content=msgpack.packb({"items": items}),  # one request: its texts share batches
        headers=MSGPACK,
        timeout=120,
    )
    assert reply.status_code == 200, reply.content[:300]
    for text, row in zip(texts, msgpack.unpackb(reply.content)["outputs"], strict=True):
        logits = np.frombuffer(row["logits"]["data"], "float32").reshape(row["logits"]["shape"])
        np.testing.assert_allclose(logits, reference("tagger", text), rtol=0, atol=TOLERANCE)


def _wire(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": "int64", "shape": list(array.shape), "data": array.astype(np.int64).tobytes()}


def test_in_process_the_text_model_tokenizes_and_says_what_it_truncated(
    repository: Path, reference: Reference
) -> None:
    texts = ["hello world", "the quick brown fox " * 20]
    with TextServedModel.from_repository(repository, "classifier", isolation="thread") as model:
        rows = model.infer_many_sync(
            [{"TEXT": np.array([t.encode()], dtype=object)} for t in texts]
        )
    for text, row in zip(texts, rows, strict=True):
        np.testing.assert_allclose(row["logits"], reference("classifier", text), atol=TOLERANCE)
    assert [row.parameters["truncated"] for row in rows] == [False, True]  # type: ignore[attr-defined]


async def test_tokenizing_runs_on_the_request_pool_never_on_the_loop(repository: Path) -> None:
    model = TextServedModel.from_repository(repository, "classifier", isolation="thread")
    threads: list[str] = []
    encode = model.encoder.encode

    def spy(texts: list[str]) -> Any:
        threads.append(threading.current_thread().name)
        return encode(texts)

    model.encoder.encode = spy  # type: ignore[method-assign]
    async with model:
        texts = [np.array([t.encode()], dtype=object) for t in ("hello", "dog " * 100)]
        await asyncio.gather(*(model.infer_many([{"TEXT": text}]) for text in texts))
    assert len(threads) == 2
    assert all(name.startswith("tensorserve-request") for name in threads), threads


def test_the_weights_take_the_dtype_asked_for_on_their_device(tmp_path: Path) -> None:
    default = TransformersOptions(task="feature-extraction")
    assert device_dtype(default, torch.device("cuda")) == torch.float16  # no GPU needed
    assert device_dtype(default, torch.device("cpu")) == torch.float32
    asked = TransformersOptions(task="feature-extraction", torch_dtype="bfloat16")
    assert device_dtype(asked, torch.device("cuda")) == torch.bfloat16
    repo = _one_model(
        tmp_path,
        'platform = "huggingface_transformers"\n[transformers]\ntask = "feature-extraction"\n'
        'inputs = "ids"\ntorch_dtype = "bfloat16"\n',
        task="feature-extraction",
    )
    source = discover(repo)["m"]
    model = load_model(source, None, read_config(source)).module
    assert model.network.config._attn_implementation == "sdpa"
    assert next(model.network.parameters()).dtype == torch.float32  # loaded on the CPU as is
    model.to(torch.device("cpu"))  # what the executor does: to the device, in its dtype
    assert next(model.network.parameters()).dtype == torch.bfloat16


def test_metadata_and_config_show_the_derived_tensors(server: ServerProcess) -> None:
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        metadata = client.get_model_metadata("tagger")
        config = client.get_model_config("features")
    finally:
        client.close()
    triton = ("name", "datatype", "shape")
    assert [{k: t[k] for k in triton} for t in metadata["inputs"]] == [
        {"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]}
    ]
    assert [{k: t[k] for k in triton} for t in metadata["outputs"]] == [
        {"name": "logits", "datatype": "FP32", "shape": [-1, -1, 3]}
    ]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("TEXT", "TYPE_STRING", [1])
    ]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        ("last_hidden_state", "TYPE_FP32", [-1, 32])
    ]


def test_bytes_that_are_not_text_are_a_400_naming_the_input(server: ServerProcess) -> None:
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        with pytest.raises(InferenceServerException) as caught:
            tensor = triton_http.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[b"ok \xff\xfe"]], dtype=object))
            client.infer("classifier", [tensor])
    finally:
        client.close()
    assert caught.value.status() == "400"
    assert caught.value.message() == (
        "item 0, feature 'TEXT': element 0 is not UTF-8 text: byte 0xff at position 3 "
        "(invalid start byte)"
    )


def test_front_ends_send_text_and_the_scheduler_process_tokenizes(
    repository: Path, reference: Reference, tmp_path: Path
) -> None:
    names = ["st_embedder", "tagger"]  # a pooled output and a per-token one, in threads: lean
    for name in names:
        shutil.copytree(repository / name, tmp_path / name)
        task, _, extra = MODELS[name]
        (tmp_path / name / "config.toml").write_text(_config(task, "thread", extra))
    process = ServerProcess(str(tmp_path), ["--frontends", "2"], ready_timeout=150).start()
    try:
        _check_all(lambda name, text: _msgpack_call(process.url, name, text), reference, 4, names)
    finally:
        process.stop()


# ------------------------------------------------------------- config, no server
def _one_model(tmp_path: Path, config: str, task: str = "text-classification") -> Path:
    folder = tmp_path / "m" / "1"
    write_checkpoint(folder, task)
    (tmp_path / "m" / "config.toml").write_text(config)
    return tmp_path


def test_three_lines_serve_a_checkpoint_and_ids_inputs_take_the_pad_id(tmp_path: Path) -> None:
    repo = _one_model(
        tmp_path,
        'platform = "huggingface_transformers"\n[transformers]\ntask = "text-classification"\n',
    )
    config = read_config(discover(repo)["m"])
    assert [(s.name, s.dtype, s.shape, s.utf8) for s in config.input] == [
        ("TEXT", "bytes", [1], True)
    ]
    assert [(s.name, s.dtype, s.shape) for s in config.output] == [("logits", "float32", [3])]
    assert config.transformers is not None and config.transformers.max_length == 64
    # A declared input that matches is checked, and the derived one serves (UTF-8 checked).
    (repo / "m" / "config.toml").write_text(
        'platform = "huggingface_transformers"\n[[input]]\nname = "TEXT"\ndtype = "bytes"\n'
        'shape = [1]\n[transformers]\ntask = "text-classification"\n'
    )
    assert read_config(discover(repo)["m"]).input[0].utf8
    (repo / "m" / "config.toml").write_text(
        'platform = "huggingface_transformers"\n[transformers]\ntask = "token-classification"\n'
        'inputs = "ids"\nmax_length = 16\n'
    )
    config = read_config(discover(repo)["m"])
    ids, mask = config.input
    assert (ids.name, ids.shape, ids.pad_value, ids.max_length, ids.max_value) == (
        "input_ids",
        [-1],
        0,
        16,
        199,
    )
    assert (mask.name, mask.pad_value, mask.max_value) == ("attention_mask", 0, 1)
    assert config.unpad_source(config.output[0]) == "input_ids"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            '[[output]]\nname = "logits"\ndtype = "float32"\nshape = [5]\n',
            "m/config.toml: [[output]] declares [('logits', 'float32', [5])] but the checkpoint "
            "gives [('logits', 'float32', [3])]",
        ),
        (
            'taks = "x"\n',
            "m/config.toml: transformers.taks: Extra inputs are not permitted",
        ),
        (
            "max_length = 500\n",
            "m/config.toml: [transformers] max_length = 500 is past the model's 128 usable "
            "positions",
        ),
    ],
    ids=["declared-mismatch", "typo", "too-long"],
)
def test_a_config_that_does_not_fit_is_one_sentence(
    tmp_path: Path, extra: str, message: str
) -> None:
    head = 'platform = "huggingface_transformers"\n'
    if extra.startswith("[[output]]"):
        text = head + extra + '[transformers]\ntask = "text-classification"\n'
    else:
        text = head + '[transformers]\ntask = "text-classification"\n' + extra
    repo = _one_model(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        read_config(discover(repo)["m"])
    assert str(caught.value) == message


def test_no_weights_pickled_weights_and_remote_code_are_refused(tmp_path: Path) -> None:
    repo = _one_model(
        tmp_path,
        'platform = "huggingface_transformers"\n[transformers]\ntask = "text-classification"\n',
    )
    folder = repo / "m" / "1"
    weights = folder / "model.safetensors"
    weights.rename(folder / "pytorch_model.bin")
    with pytest.raises(ConfigError) as caught:
        read_config(discover(repo)["m"])
    assert str(caught.value) == (
        "m/config.toml: m/1 holds pytorch_model.bin but no model.safetensors; tensorserve "
        "never unpickles: save it with save_pretrained(safe_serialization=True)"
    )
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(
        ConfigError, match=r"^m/config.toml: m/1 holds no weights \(model.safetensors\)$"
    ):
        read_config(discover(repo)["m"])
    write_checkpoint(folder, "text-classification")
    checkpoint = json.loads((folder / "config.json").read_text())
    checkpoint["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(checkpoint))
    with pytest.raises(ConfigError) as caught:
        read_config(discover(repo)["m"])
    assert str(caught.value) == (
        "m/config.toml: m/1 needs the Python code it ships (config.json has auto_map); set "
        "[transformers] trust_remote_code = true to run it"
    )


def test_without_the_extra_the_load_says_the_pip_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = _one_model(
        tmp_path,
        'platform = "huggingface_transformers"\n[transformers]\ntask = "text-classification"\n'
        'inputs = "ids"\n',
    )
    source = discover(repo)["m"]
    config = read_config(source)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(ConfigError) as caught:
        load_model(source, None, config)
    assert str(caught.value) == (
        "m/1: platform 'huggingface_transformers' needs transformers and "
        "sentence-transformers: pip install 'tensorserve[transformers]'"
    )


def test_usable_positions_leave_out_robertas_padding_offset() -> None:
    assert (
        usable_positions(
            {"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1}
        )
        == 512
    )
    assert usable_positions({"model_type": "bert", "max_position_embeddings": 512}) == 512


def test_truncated_is_exact_at_the_limit_and_ids_are_the_libraries(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "c", "feature-extraction")
    library = transformers.AutoTokenizer.from_pretrained(str(folder))
    encoder = TextEncoder.from_file(str(folder / "tokenizer.json"), 8)
    texts = ["", "hello", "the quick brown fox jumps", "hello " * 6, "hello " * 7, "dog " * 100_000]
    for text, encoded in zip(texts, encoder.encode(texts), strict=True):
        whole = library(text).input_ids
        expected = library(text, truncation=True, max_length=8).input_ids
        assert encoded.input_ids.tolist() == expected
        assert encoded.attention_mask.tolist() == [1] * len(expected)
        assert encoded.truncated is (len(whole) > 8), text
