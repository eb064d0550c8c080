"""Wire protocols of the peers (one item per request): how each spells a
request for ``targets.PeerTarget`` and how its answer is decoded for the
correctness check. Pure functions of numpy arrays and bytes. tensorserve's
own protocols (msgpack, KServe v2 JSON and binary) are spelled by
``tensorserve_bench.protocols``, the encoders of ``tensorserve bench``.

Every request carries ``input_ids`` and ``attention_mask`` (int64, ones over the
real tokens).  With ``pad_to`` the *client* right-pads both to that length
(ids with 0, mask with 0), which is how a user gets Triton / MLServer to batch
variable-length items; the response is then un-padded by the client.

Protocols
---------
``msgpack``        tensorserve's native protocol (also used by the ``batched``
                   peer's aiohttp handler): msgpack ``{"items": [...]}``.
``kserve-binary``  KServe v2 / Triton HTTP with the binary tensor extension
                   (what ``tritonclient`` sends); used for PyTriton.
``kserve-json``    KServe v2 JSON (MLServer has no binary HTTP extension).
``litserve-json``  ``POST /predict`` ``{"input_ids": [...], "attention_mask": [...]}``
                   -> ``{"logits": [[...9], ...]}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgpack
import numpy as np
from tensorserve_bench.protocols import binary_body, json_body, msgpack_body

NUM_LABELS = 9
VOCAB_SIZE = 30000  # the benchmark tagger's (run.prepare_repository)


def make_items(n: int, seed: int = 1234, min_len: int = 8, max_len: int = 128,
               vocab_size: int = VOCAB_SIZE) -> list[np.ndarray]:
    """``n`` id arrays, lengths uniform in [min_len, max_len] (the correctness
    check's requests; the measured stream is tensorserve_bench's ``build_pool``)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    # id 0 is the pad id; real tokens use 1..vocab_size-1
    return [rng.integers(1, vocab_size, size=int(length), dtype=np.int64) for length in lengths]


def _padded(ids: np.ndarray, pad_to: int | None) -> tuple[np.ndarray, np.ndarray]:
    n = ids.shape[0]
    if pad_to is None or pad_to <= n:
        return ids.astype(np.int64, copy=False), np.ones(n, dtype=np.int64)
    x = np.zeros(pad_to, dtype=np.int64)
    m = np.zeros(pad_to, dtype=np.int64)
    x[:n] = ids
    m[:n] = 1
    return x, m


@dataclass(frozen=True)
class Protocol:
    """``encode(ids, pad_to) -> (body, extra request headers)``;
    ``decode(body, response headers with lower-case names, length) -> [length, 9]``."""

    name: str
    path: str
    content_type: str
    encode: Callable[[np.ndarray, int | None], tuple[bytes, dict[str, str]]]
    decode: Callable[[bytes, Mapping[str, str], int], np.ndarray]


def _item(ids: np.ndarray, pad_to: int | None) -> dict[str, np.ndarray]:
    x, m = _padded(ids, pad_to)
    return {"input_ids": x, "attention_mask": m}


# -- tensorserve msgpack -------------------------------------------------------

def _enc_msgpack(ids: np.ndarray, pad_to: int | None) -> tuple[bytes, dict[str, str]]:
    return msgpack_body([_item(ids, pad_to)], {}), {}


def _dec_msgpack(body: bytes, headers: Mapping[str, str], length: int) -> np.ndarray:
    msg = msgpack.unpackb(body, raw=False)
    t = msg["outputs"][0]["logits"]
    a = np.frombuffer(t["data"], dtype=np.dtype(t["dtype"]).newbyteorder("<"))
    return a.reshape(t["shape"]).astype(np.float32)[:length]


# -- KServe v2 binary (Triton) -------------------------------------------------

def _enc_kserve_binary(ids: np.ndarray, pad_to: int | None) -> tuple[bytes, dict[str, str]]:
    return binary_body([_item(ids, pad_to)], {}, outputs=["logits"])


def _dec_kserve_binary(body: bytes, headers: Mapping[str, str], length: int) -> np.ndarray:
    hlen = headers.get("inference-header-content-length")
    if hlen is None:  # pure JSON answer
        return _dec_kserve_json(body, headers, length)
    hlen = int(hlen)
    header = json.loads(body[:hlen])
    offset = hlen
    for out in header["outputs"]:
        size = out.get("parameters", {}).get("binary_data_size")
        if out["name"] == "logits":
            if size is None:
                a = np.asarray(out["data"], dtype=np.float32)
            else:
                a = np.frombuffer(body[offset:offset + size], dtype="<f4")
            return a.reshape(out["shape"]).reshape(-1, NUM_LABELS)[:length]
        offset += size or 0
    raise ValueError("no logits output in response")


# -- KServe v2 JSON (MLServer) ---------------------------------------------------

def _enc_kserve_json(ids: np.ndarray, pad_to: int | None) -> tuple[bytes, dict[str, str]]:
    return json_body([_item(ids, pad_to)], {}), {}


def _dec_kserve_json(body: bytes, headers: Mapping[str, str], length: int) -> np.ndarray:
    msg = json.loads(body)
    for out in msg["outputs"]:
        if out["name"] == "logits":
            a = np.asarray(out["data"], dtype=np.float32)
            return a.reshape(out["shape"]).reshape(-1, NUM_LABELS)[:length]
    raise ValueError("no logits output in response")


# -- LitServe JSON ---------------------------------------------------------------

def _enc_litserve(ids: np.ndarray, pad_to: int | None) -> tuple[bytes, dict[str, str]]:
    x, m = _padded(ids, pad_to)
    body = json.dumps({"input_ids": x.tolist(), "attention_mask": m.tolist()},
                      separators=(",", ":")).encode()
    return body, {}


def _dec_litserve(body: bytes, headers: Mapping[str, str], length: int) -> np.ndarray:
    msg = json.loads(body)
    return np.asarray(msg["logits"], dtype=np.float32).reshape(-1, NUM_LABELS)[:length]


PROTOCOLS: dict[str, Protocol] = {
    "msgpack": Protocol("msgpack", "/v2/models/tagger/infer", "application/msgpack",
                        _enc_msgpack, _dec_msgpack),
    "kserve-binary": Protocol("kserve-binary", "/v2/models/tagger/infer",
                              "application/octet-stream", _enc_kserve_binary,
                              _dec_kserve_binary),
    "kserve-json": Protocol("kserve-json", "/v2/models/tagger/infer", "application/json",
                            _enc_kserve_json, _dec_kserve_json),
    "litserve-json": Protocol("litserve-json", "/predict", "application/json",
                              _enc_litserve, _dec_litserve),
}
