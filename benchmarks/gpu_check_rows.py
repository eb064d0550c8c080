"""Checks of benchmarks/gpu_check.py that send many requests at once over
HTTP and check each caller's own rows:

    many_callers   ``callers`` concurrent one-item requests of different
                   lengths (so batches mix callers and pad): each reply equal
                   to its own item run alone on the CPU, within the model's
                   per-dtype tolerance
    text_rows      strings in: the tokenizer's ids equal the tokenizers
                   library's; an ensemble's outputs (the tokenizer, then a
                   model) equal tokenizing on the CPU then that model run
                   alone on the CPU. Texts of different token counts sent
                   at once, over KServe v2 JSON (BYTES in).

Each counts its comparisons (``Check.compared``): none compared is a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gpu_check_support import (
    Check,
    CpuReference,
    ModelInfo,
    Server,
    drift_hint,
    encode,
    infer,
    make_items,
    max_abs_error,
    tolerance,
)

TEXT_COUNT = 32


async def many_callers(session: Any, server: Server, model: ModelInfo, isolation: str,
                       reference: CpuReference, rng: np.random.Generator, device: str,
                       callers: int) -> Check:  # fmt: skip
    items = make_items(model, callers, rng)
    replies = await asyncio.gather(
        *(infer(session, server.url, model.name, encode([item])) for item in items))
    worst, scale, problems, compared = 0.0, 0.0, [], 0
    for reply, item in zip(replies, items, strict=True):
        if reply.status != 200:
            problems.append(f"HTTP {reply.status}: {reply.error}")
            continue
        error, magnitude, shape = max_abs_error(reply.outputs[0], reference.expected(model, item))
        if shape:
            problems.append(shape)
            continue
        compared += 1
        worst, scale = max(worst, error), max(scale, magnitude)
    bound = tolerance(model, device, scale)
    if worst > bound:
        problems.append(f"max abs error {worst:.2e} over {bound:.1e}"
                        + drift_hint(model, device, worst, scale))  # fmt: skip
    detail = (f"{compared} of {callers} concurrent callers' rows checked, max abs error "
              f"{worst:.2e} (tolerance {bound:.1e}, {model.compute_dtype(device)})")
    return Check("many_callers", model.name, isolation, not problems,
                 "; ".join(problems[:3]) + (" | " if problems else "") + detail,
                 compared=compared)  # fmt: skip


# ----------------------------------------------------------------- strings in
def texts(tokenizer_file: Path, rng: np.random.Generator, count: int = TEXT_COUNT) -> list[str]:
    """Texts of 0..40 words from the tokenizer's vocabulary, some with words
    it splits or does not know: different token counts, one request each."""
    import json

    vocab = json.loads(tokenizer_file.read_text())["model"]["vocab"]
    words = sorted(w for w in vocab if w.isalpha() and w.isascii() and len(w) > 1)
    extra = ["zebras", "café", "naïve", "☃", "tokenisation", "GPU", "12345", ","]
    out = ["", "Hello world"]
    while len(out) < count:
        n = int(rng.integers(1, 41))
        picked = list(rng.choice(words, size=n))
        if rng.random() < 0.5:
            picked.insert(int(rng.integers(0, n)), str(rng.choice(extra)))
        out.append(" ".join(picked))
    return out


async def infer_text(session: Any, url: str, model: str, text: str) -> tuple[int, dict[str, Any]]:
    """One text over KServe v2 JSON: (status, {output name: array})."""
    body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    async with session.post(f"{url}/v2/models/{model}/infer", json=body) as response:
        payload = await response.json(content_type=None)
        if response.status != 200:
            return response.status, {"error": payload}
    arrays = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in payload["outputs"]}
    return 200, arrays


def ensemble_steps(model: ModelInfo) -> list[dict[str, Any]]:
    return list(model.config.get("ensemble_scheduling", {}).get("step", []))


async def text_rows(session: Any, server: Server, model: ModelInfo, models: Sequence[ModelInfo],
                    isolation: str, reference: CpuReference, tokenizer_file: Path,
                    rng: np.random.Generator, device: str) -> Check:  # fmt: skip
    """The tokenizer itself, or an ensemble whose first step is it."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_truncation(512)
    sent = texts(tokenizer_file, rng)
    replies = await asyncio.gather(*(infer_text(session, server.url, model.name, t) for t in sent))
    problems, compared, worst, scale = [], 0, 0.0, 0.0
    steps = ensemble_steps(model)
    step = next((m for m in models if steps and m.name == steps[-1]["model_name"]), None)
    if steps and step is None:
        return Check("text_rows", model.name, isolation, False,
                     f"its last step {steps[-1]['model_name']!r} is not served here")
    for text, (status, outputs) in zip(sent, replies, strict=True):
        if status != 200:
            problems.append(f"HTTP {status} for {text[:20]!r}: {str(outputs)[:160]}")
            continue
        encoding = tokenizer.encode(text)
        ids = np.array(encoding.ids, dtype=np.int64)
        if step is None:  # the tokenizer: its ids, exactly
            got = outputs["input_ids"].reshape(-1)
            if not np.array_equal(got, ids):
                problems.append(f"ids of {text[:20]!r}: {got[:8].tolist()}.., want {ids[:8].tolist()}..")
            compared += 1
            continue
        expected = reference.expected(step, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        renamed = {v: k for k, v in steps[-1].get("output_map", {}).items()}  # ours -> the step's
        got = {renamed.get(name, name): value[0] for name, value in outputs.items()}
        error, magnitude, shape = max_abs_error(got, expected)
        if shape:
            problems.append(f"{text[:20]!r}: {shape}")
            continue
        compared += 1
        worst, scale = max(worst, error), max(scale, magnitude)
    if step is not None:
        bound = tolerance(step, device, scale)
        if worst > bound:
            problems.append(f"max abs error {worst:.2e} over {bound:.1e}"
                            + drift_hint(step, device, worst, scale))  # fmt: skip
        how = (f"max abs error {worst:.2e} (tolerance {bound:.1e}, "
               f"{step.compute_dtype(device)}) against tokenizing then {step.name} on the CPU")
    else:
        how = "ids equal to the tokenizers library's"
    detail = f"{compared} of {len(sent)} concurrent texts checked: {how}"
    return Check("text_rows", model.name, isolation, not problems,
                 "; ".join(problems[:3]) + (" | " if problems else "") + detail,
                 compared=compared)  # fmt: skip
