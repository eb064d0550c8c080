"""The bundled text models (issue #39, items 3 and 4) against a real server
process on loopback serving the bundled repository: tritonclient, over
HTTP and gRPC, sends strings to ``text_tagger`` and each caller gets its own
un-padded logits, equal to tokenizing on the client and calling ``tagger``
itself; ``text_embedder`` likewise over ``embedder``; bad strings are 400s
with exact messages.

The callers send texts of different token counts at the same time, so the
steps' batches mix callers and pad: a caller given another's row, or a row
not cut back to its own length, differs from its reference at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tokenizers import Tokenizer
from tritonclient.utils import InferenceServerException

from tests.conftest import REPOSITORY, ServerProcess

TEXTS = [
    "Hello world",
    "The tagger reads a sentence and gives each token nine scores.",
    "",
    "café naïve ☃ über",
    "word " * 600,  # truncated at 512 tokens
    "Short.",
    "A much longer sentence, with several clauses, commas and a few unusual words in it.",
    "zebras",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(REPOSITORY / "tokenizer" / "1" / "tokenizer.json"))
    tokenizer.enable_truncation(512)
    return tokenizer


def _ids(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoding = tokenizer.encode(text)
    ids = np.array([encoding.ids], dtype=np.int64)
    return ids, np.array([encoding.attention_mask], dtype=np.int64)


def _text(module: Any, text: str | bytes) -> Any:
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text]], dtype=object))
    return tensor


def _ids_inputs(module: Any, ids: np.ndarray, mask: np.ndarray) -> list[Any]:
    inputs = [module.InferInput(n, list(a.shape), "INT64") for n, a in (("input_ids", ids), ("attention_mask", mask))]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    return inputs


@pytest.fixture(scope="module")
def http_client(server: ServerProcess) -> Iterator[Callable[[], Any]]:
    address = server.url.removeprefix("http://")
    clients: list[Any] = []

    def new() -> Any:  # one per thread: tritonclient's HTTP client is not thread-safe
        clients.append(triton_http.InferenceServerClient(address))
        return clients[-1]

    yield new
    for client in clients:
        client.close()


@pytest.fixture(scope="module")
def grpc_client(server: ServerProcess) -> Iterator[Any]:
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    yield client
    client.close()


def _each_caller_gets_its_own_logits(
    module: Any, client_for: Callable[[], Any], tokenizer: Tokenizer
) -> None:
    def ensemble(text: str) -> np.ndarray:
        reply = client_for().infer("text_tagger", [_text(module, text)])
        return reply.as_numpy("logits")

    with ThreadPoolExecutor(len(TEXTS)) as pool:  # all at once: the steps' batches mix callers
        got = list(pool.map(ensemble, TEXTS))
    direct = client_for()
    for text, logits in zip(TEXTS, got):
        ids, mask = _ids(tokenizer, text)
        expected = direct.infer("tagger", _ids_inputs(module, ids, mask)).as_numpy("logits")
        assert logits.shape == (1, ids.shape[1], 9), text[:20]
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-5, err_msg=text[:20])
    assert got[4].shape == (1, 512, 9)  # truncated, as the tagger's max_length asks


def test_tritonclient_http_sends_strings_and_gets_each_callers_own_logits(
    http_client: Callable[[], Any], tokenizer: Tokenizer
) -> None:
    _each_caller_gets_its_own_logits(triton_http, http_client, tokenizer)


def test_tritonclient_grpc_sends_strings_and_gets_each_callers_own_logits(
    grpc_client: Any, tokenizer: Tokenizer
) -> None:
    _each_caller_gets_its_own_logits(triton_grpc, lambda: grpc_client, tokenizer)


def test_text_embedder_equals_tokenizing_then_embedder_with_parameters_passed_on(
    grpc_client: Any, tokenizer: Tokenizer
) -> None:
    for normalize in (True, False):
        for text in TEXTS[:4]:
            got = grpc_client.infer(
                "text_embedder", [_text(triton_grpc, text)], parameters={"normalize": normalize}
            )
            direct = grpc_client.infer(
                "embedder",
                _ids_inputs(triton_grpc, *_ids(tokenizer, text)),
                parameters={"normalize": normalize},
            )
            np.testing.assert_allclose(
                got.as_numpy("embedding"), direct.as_numpy("embedding"), rtol=1e-4, atol=1e-6
            )
        norm = float(np.linalg.norm(got.as_numpy("embedding")))
        assert (abs(norm - 1) < 1e-4) is normalize


NOT_UTF8 = (
    "item 0, feature 'TEXT': element 0 is not UTF-8 text: byte 0xff at position 3 "
    "(invalid start byte)"
)


@pytest.mark.parametrize("module", [triton_http, triton_grpc], ids=["http", "grpc"])
def test_bytes_that_are_not_text_are_a_400_before_any_step(
    module: Any, http_client: Callable[[], Any], grpc_client: Any
) -> None:
    client = http_client() if module is triton_http else grpc_client
    with pytest.raises(InferenceServerException) as caught:
        client.infer("text_tagger", [_text(module, b"ok \xff\xfe")])
    assert caught.value.message() == NOT_UTF8
    assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_a_number_or_a_string_too_long_is_a_400_naming_the_input(
    http_client: Callable[[], Any],
) -> None:
    client = http_client()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("text_tagger", [_text(triton_http, b"x" * (1 << 20 | 1))])
    assert caught.value.message() == (
        "item 0, feature 'TEXT': element 0 is 1048577 bytes long; the server's "
        "max_bytes_element_length is 1048576"
    )
    number = triton_http.InferInput("TEXT", [1, 1], "FP32")
    number.set_data_from_numpy(np.array([[1.5]], dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("text_tagger", [number])
    assert caught.value.message() == "input 'TEXT': datatype FP32 does not match the model's BYTES"


def test_the_ensembles_are_models_to_triton_clients(grpc_client: Any) -> None:
    assert grpc_client.is_model_ready("text_tagger")
    metadata = grpc_client.get_model_metadata("text_tagger", as_json=True)
    assert metadata["platform"] == "ensemble"
    assert [(t["name"], t["datatype"]) for t in metadata["inputs"]] == [("TEXT", "BYTES")]
    config = grpc_client.get_model_config("text_embedder", as_json=True)["config"]
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["tokenizer", "embedder"]
    assert steps[0]["output_map"] == {"input_ids": "ids", "attention_mask": "mask"}
    index = {m["name"]: m["state"] for m in grpc_client.get_model_repository_index(as_json=True)["models"]}
    assert index["text_tagger"] == index["text_embedder"] == index["tokenizer"] == "READY"


def test_utf8_is_for_a_bytes_input_and_checks_every_element() -> None:
    from tensorserve.errors import ConfigError, InvalidInput
    from tensorserve.repository.config import parse_config
    from tensorserve.tensors.bytes_tensor import check_utf8

    with pytest.raises(ConfigError) as caught:
        parse_config(
            {"input": [{"name": "x", "dtype": "int64", "shape": [1], "utf8": True}],
             "output": [{"name": "y", "dtype": "int64", "shape": [1]}]},
            "m/config.toml",
        )  # fmt: skip
    assert str(caught.value) == (
        "m/config.toml: input[0]: input 'x': utf8 = true is for a bytes input, not int64"
    )
    check_utf8(np.array(["héllo", "é".encode()], dtype=object), "x")  # str and UTF-8 bytes pass
    with pytest.raises(InvalidInput) as refused:
        check_utf8(np.array([b"fine", b"caf\xe9"], dtype=object), "x")
    assert refused.value.message == (
        "x: element 1 is not UTF-8 text: byte 0xe9 at position 3 (unexpected end of data)"
    )
