"""What a model's batching settings left to the server become on the device it
runs on: one pure function of (config, device type), called once the device
is known (``ServedModel``), so one config.toml suits a CPU and a GPU.

=====================  ==================================  ==========================================
setting                on a CPU                            on a GPU
=====================  ==================================  ==========================================
max_batch_tokens auto  learnt (``batching/budget.py``)     max_batch_size items of full length
pad_to_multiple_of     none                                8; 64 with torch.compile's CUDA
(unset)                                                    graphs (max-autotune)
=====================  ==================================  ==========================================

Why they differ. On a CPU a batch costs about what its padded elements cost,
and past the caches more per element, so a budget on the padded volume pays
(learnt, it served four of the five bundled models better than the hand-set
1024 tokens and the GRU tagger within noise of it: docs/performance.md,
"Defaults, measured on every bundled model"). On a GPU a batch of a few
thousand tokens typically costs about what one item does (not yet measured
with the bundled models): the device is fastest with
the biggest batches, so the budget only keeps a batch to ``max_batch_size``
items of full length (at most ``max_batch_elements``), and learning one
would only cost the smaller batches it explores. Every distinct padded shape
is a new plan for the GPU's libraries, and under CUDA graphs a new capture
(memory and a pause), so lengths are rounded up: to 8 (a tensor core's
multiple), or to 64 when torch.compile captures CUDA graphs (max-autotune),
which bounds its captures to ``max_length / 64`` lengths per batch size. The
server's own graphs (compile "auto", "reduce-overhead") need no coarser
multiple: each batch replays the graph of its power-of-two bucket
(``runtime/graph_buckets.py``), which bounds the captures by itself. A value set in
config.toml (or by the server's settings) is kept on every device.
"""

from __future__ import annotations

from tensorserve.repository.config import DEFAULT_MAX_LENGTH, ModelConfig

# Lengths rounded up on a GPU: a multiple of 8 suits tensor cores and keeps
# the shapes the libraries plan for few; torch.compile's CUDA graphs capture
# each shape, so max-autotune gets coarser buckets (the server's own graphs,
# reduce-overhead, round up to their buckets themselves).
GPU_PAD_MULTIPLE = 8
CUDA_GRAPH_PAD_MULTIPLE = 64
CUDA_GRAPH_MODES = frozenset({"max-autotune"})


def for_device(config: ModelConfig, device_type: str) -> ModelConfig:
    """``config`` with ``max_batch_tokens = "auto"`` and an unset
    ``pad_to_multiple_of`` resolved for ``device_type`` ("cpu", "cuda"; any
    other torch device type is treated as a GPU). On a CPU "auto" stays
    "auto": the batcher learns the budget there."""
    batching = config.dynamic_batching
    if device_type == "cpu":
        return config
    multiple = batching.pad_to_multiple_of
    if multiple is None:
        multiple = (
            CUDA_GRAPH_PAD_MULTIPLE if config.compile in CUDA_GRAPH_MODES else GPU_PAD_MULTIPLE
        )
    budget = batching.max_batch_tokens
    if budget == "auto":
        budget = full_batch_volume(config)
    update = {"pad_to_multiple_of": multiple, "max_batch_tokens": budget}
    return config.model_copy(update={"dynamic_batching": batching.model_copy(update=update)})


def full_batch_volume(config: ModelConfig) -> int:
    """The padded volume of ``max_batch_size`` items of full length (every
    variable axis of the first variable input at its ``max_length``, which
    rounding never passes: ``collate.padded_shape``), as ``Collator.volume``
    counts it, at most ``max_batch_elements``: a budget that never splits a
    batch the model could take whole."""
    primary = next((spec for spec in config.input if spec.variable_axes), None)
    item = 1
    if primary is not None:
        item = (primary.max_length or DEFAULT_MAX_LENGTH) ** len(primary.variable_axes)
    return min(max(1, config.max_batch_size) * item, config.dynamic_batching.max_batch_elements)
