"""Pure-torch checks of the bundled example models (no server involved).

For each model in model_repository/: load model.py + model.safetensors
(strict), pad a batch of items of different lengths with the config's
pad_values, run forward, and check every row (sliced back to its true extent)
equals running that item alone, unpadded.
"""

from __future__ import annotations

import importlib.util

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent / "model_repository"
EXAMPLES = REPO.parent / "examples" / "model_repository"  # models that need an extra
MODELS = ["tagger", "embedder", "image_filter", "gru_tagger", "attention_tagger"]
ATOL = 1e-5
RTOL = 1e-5


def _config(name: str) -> dict:
    with open(REPO / name / "config.toml", "rb") as f:
        return tomllib.load(f)


def _load(name: str) -> torch.nn.Module:
    path = REPO / name / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"_ex_{name}_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Model(**_config(name).get("parameters", {}))
    model.load_state_dict(load_file(str(REPO / name / "1" / "model.safetensors")), strict=True)
    return model.eval()


@pytest.fixture(scope="module", params=MODELS)
def loaded(request):
    return request.param, _config(request.param), _load(request.param)


def _make_items(name: str, cfg: dict, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    items = []
    if name == "image_filter":
        for h, w in [(5, 9), (12, 3), (1, 1), (8, 8), (3, 14)]:
            items.append({"image": torch.randn(h, w, generator=gen)})
    else:
        vocab = cfg["parameters"]["vocab_size"]
        for n in [7, 1, 23, 12]:
            # Real tokens may include id 0 (== pad_value): masking must rely on
            # attention_mask, not on the ids.
            ids = torch.randint(0, vocab, (n,), generator=gen)
            ids[0] = 0
            items.append({"input_ids": ids, "attention_mask": torch.ones(n, dtype=torch.int64)})
    return items


def _pad_batch(cfg: dict, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = {}
    for spec in cfg["input"]:
        name = spec["name"]
        tensors = [item[name] for item in items]
        max_shape = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
        out = torch.full([len(tensors), *max_shape], spec["pad_value"], dtype=tensors[0].dtype)
        for i, t in enumerate(tensors):
            out[(i, *(slice(0, s) for s in t.shape))] = t
        batch[name] = out
    return batch


def _outputs(cfg: dict, result) -> dict[str, torch.Tensor]:
    if isinstance(result, torch.Tensor):
        assert len(cfg["output"]) == 1
        return {cfg["output"][0]["name"]: result}
    return dict(result)


def _true_shape(cfg: dict, out_spec: dict, item: dict) -> list[int]:
    """The output's per-item shape: -1 axes take the unpad_like input's extents, in order."""
    like = out_spec.get("unpad_like")
    if like is None:
        return list(out_spec["shape"])
    in_spec = next(s for s in cfg["input"] if s["name"] == like)
    extents = iter(item[like].shape[d] for d, s in enumerate(in_spec["shape"]) if s == -1)
    return [next(extents) if s == -1 else s for s in out_spec["shape"]]


# "inference": torch.inference_mode, where nn.TransformerEncoder may take the
# fused / nested-tensor fast path; "autograd": grad enabled, forcing the
# regular Python path.  Real positions must be correct either way.
MODES = {
    "inference": torch.inference_mode,
    "autograd": torch.enable_grad,
}


@pytest.mark.parametrize("mode", list(MODES))
def test_padded_batch_matches_items_alone(loaded, mode):
    name, cfg, model = loaded
    gen = torch.Generator().manual_seed(1234)
    items = _make_items(name, cfg, gen)
    batch = _pad_batch(cfg, items)
    with MODES[mode]():
        batched = _outputs(cfg, model(**batch))
        for i, item in enumerate(items):
            alone = _outputs(cfg, model(**{k: v.unsqueeze(0) for k, v in item.items()}))
            for spec in cfg["output"]:
                out_name = spec["name"]
                got = batched[out_name]
                assert got.shape[0] == len(items)
                assert got.dtype == getattr(torch, spec["dtype"])
                true_shape = _true_shape(cfg, spec, item)
                row = got[i][tuple(slice(0, n) for n in true_shape)]
                ref = alone[out_name][0]
                assert list(ref.shape) == true_shape
                torch.testing.assert_close(row, ref.detach(), atol=ATOL, rtol=RTOL)


def test_embedder_unit_norm():
    model = _load("embedder")
    ids = torch.randint(1, 4096, (3, 10))
    with torch.inference_mode():
        emb = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert emb.shape == (3, 64)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))


@pytest.mark.parametrize("name", ["tagger", "embedder"])
def test_all_padding_row_is_finite_and_isolated(name):
    """A row with no real tokens must not produce NaN or disturb other rows."""
    model = _load(name)
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask)
        alone = model(input_ids=ids[:1], attention_mask=mask[:1])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:1], alone, atol=ATOL, rtol=RTOL)


def test_make_variant_rewrites_parameters_and_weights(tmp_path):
    """scripts/generate_example_weights.make_variant: copy + override + weights."""
    script = REPO.parent / "scripts" / "generate_example_weights.py"
    spec = importlib.util.spec_from_file_location(f"_gen_{uuid.uuid4().hex}", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    dst = gen.make_variant(REPO / "gru_tagger", tmp_path / "gru_big", {"vocab_size": 5000})
    cfg = tomllib.loads((dst / "config.toml").read_text())
    assert cfg["parameters"]["vocab_size"] == 5000
    # The ids' bound follows the vocabulary; nothing else of the inputs changes.
    assert [i.pop("max_value", None) for i in cfg["input"]] == [4999, None]
    assert [i.pop("max_value", None) for i in _config("gru_tagger")["input"]] == [4095, None]
    assert cfg["input"] == [{k: v for k, v in i.items() if k != "max_value"}
                            for i in _config("gru_tagger")["input"]]
    weights = load_file(str(dst / "1" / "model.safetensors"))
    assert weights["embed.weight"].shape == (5000, 128)
    first = (dst / "1" / "model.safetensors").read_bytes()
    gen.write_weights(dst)
    assert (dst / "1" / "model.safetensors").read_bytes() == first  # deterministic


def test_tagger_onnx_is_the_tagger_exported(tmp_path):
    """examples/model_repository/tagger_onnx/1/model.onnx, run by ONNX Runtime on a padded
    batch, gives each row what the tagger's model.py gives the item alone."""
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(EXAMPLES / "tagger_onnx" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    cfg, model = _config("tagger"), _load("tagger")
    items = _make_items("tagger", cfg, torch.Generator().manual_seed(99))
    batch = _pad_batch(tomllib.loads((EXAMPLES / "tagger_onnx" / "config.toml").read_text()), items)
    (logits,) = session.run(["logits"], {k: v.numpy() for k, v in batch.items()})
    with torch.inference_mode():
        for i, item in enumerate(items):
            alone = model(**{k: v.unsqueeze(0) for k, v in item.items()})[0]
            n = item["input_ids"].shape[0]
            torch.testing.assert_close(torch.from_numpy(logits[i, :n]), alone, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- no host syncs in forward
# On a GPU, reading a tensor's value on the host (bool(t), t.item(), t.tolist(),
# t.cpu(), a Python branch on a value) waits for the device to finish. There is
# no GPU here, so the check is structural: forward runs on the meta device
# (not the CPU, as a GPU is not, and it holds no values, so any read raises)
# with the ways Python reads a value patched to raise as well.
_HOST_READS = ("__bool__", "item", "tolist", "cpu", "numpy")


def _meta_inputs(name: str, cfg: dict) -> dict:
    if name == "image_filter":
        return {"image": torch.zeros(3, 5, 7)}
    ids = torch.zeros(3, 9, dtype=torch.int64)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if any(p["name"] == "normalize" for p in cfg.get("request_parameter", [])):
        inputs["normalize"] = [True, False, True]  # the served embedder's per-row flags
    return inputs


def _module(name: str):
    path = REPO / name / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"_ex_{name}_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", MODELS)
def test_forward_off_the_cpu_reads_no_value_on_the_host(name, monkeypatch):
    cfg = _config(name)
    with torch.device("meta"):
        model = _module(name).Model(**cfg.get("parameters", {})).eval()
        inputs = _meta_inputs(name, cfg)

    def read(self, *args, **kwargs):
        raise AssertionError(f"forward read a tensor's value on the host ({self.shape})")

    for method in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, method, read)
    with torch.inference_mode():
        result = model(**inputs)
    monkeypatch.undo()
    first = next(iter(_outputs(cfg, getattr(result, "outputs", result)).values()))
    assert first.device.type == "meta" and first.shape[0] == 3


@pytest.mark.parametrize("name", ["tagger", "embedder"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_path_off_the_cpu_matches_items_alone_too(name, mode, monkeypatch):
    """The tagger and embedder skip padded positions on the CPU (a nested
    tensor, whose lengths a GPU would have to send to the host); elsewhere
    every layer runs on the padded batch with the mask. Run that path here."""
    cfg, model = _config(name), _load(name)
    monkeypatch.setattr(model, "_encode", model._encode_padded)
    items = _make_items(name, cfg, torch.Generator().manual_seed(4321))
    items.append({"input_ids": torch.tensor([0, 0]), "attention_mask": torch.zeros(2, dtype=torch.int64)})
    with MODES[mode]():
        batched = _outputs(cfg, model(**_pad_batch(cfg, items)))
        reference = _outputs(cfg, _load(name)(**_pad_batch(cfg, items)))  # the CPU's own path
        for i, item in enumerate(items):
            alone = _outputs(cfg, model(**{k: v.unsqueeze(0) for k, v in item.items()}))
            for spec in cfg["output"]:
                row = batched[spec["name"]][i][tuple(slice(0, n) for n in _true_shape(cfg, spec, item))]
                torch.testing.assert_close(row, alone[spec["name"]][0].detach(), atol=ATOL, rtol=RTOL)
    for key, value in batched.items():
        assert torch.isfinite(value).all()  # the row with no real token too
        if name == "embedder":  # one vector per row, padding or not: the paths agree
            torch.testing.assert_close(value, reference[key], atol=ATOL, rtol=RTOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", MODELS)
def test_forward_on_cuda_never_synchronises(name):
    """What the meta-device test stands in for: forward on a GPU under
    torch.cuda.set_sync_debug_mode("error"), which raises at any operation
    that makes the host wait for the device."""
    cfg, model = _config(name), _load(name).to("cuda")
    items = _make_items(name, cfg, torch.Generator().manual_seed(7))
    batch = {k: v.to("cuda") for k, v in _pad_batch(cfg, items).items()}
    if name == "embedder":
        batch["normalize"] = [True, False] * (len(items) // 2) + [True] * (len(items) % 2)
    torch.cuda.synchronize()
    with torch.inference_mode():
        model(**batch)  # first call: lazy initialisation may synchronise
        torch.cuda.synchronize()
        try:
            with warnings.catch_warnings():
                # Turning the mode on warns that it is a prototype; pytest's
                # filterwarnings = error made that warning the failure, with the
                # mode left on for every later test.
                warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
                torch.cuda.set_sync_debug_mode("error")
            result = model(**batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    first = next(iter(_outputs(cfg, getattr(result, "outputs", result)).values()))
    assert first.is_cuda and torch.isfinite(first).all()
