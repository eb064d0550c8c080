"""``MemoryCeiling``: the most padded elements a batch of a model may hold,
learnt from the batches that ran out of memory (recovery halves a batch
that did; the queue forms batches under the ceiling)."""

from __future__ import annotations

from collections.abc import Callable


class MemoryCeiling:
    """A learned bound on one batch's padded elements: halved below a batch
    that ran out of memory, raised again slowly (by ``GROWTH`` after every
    ``GROW_AFTER`` batches that fit) so one bad moment does not shrink the
    model's batches forever. The queue forms batches under it.

    Where the executor can tell how much device memory is free (``free_bytes``:
    CUDA, in this process), the ceiling grows only once more is free than when
    the batch ran out: on a GPU that other processes share, growing blindly
    would run out again on purpose, over and over."""

    GROW_AFTER = 32
    GROWTH = 1.25

    def __init__(self, free_bytes: Callable[[], int | None] = lambda: None) -> None:
        self.limit: int | None = None  # None: nothing learned yet
        self._fitted = 0
        self._free_bytes = free_bytes
        self._free_when_out: int | None = None  # bytes free after the last batch ran out
        # The largest padded batch that fit since memory last ran out: the
        # evidence that an item this size fits when memory is not tight.
        self.largest_fit = 0

    def ran_out(self, padded_elements: int) -> bool:
        """A batch of this size ran out of memory. True if one at least as
        large fit since the last time memory ran out: memory is tight for
        now, not too small for it (413 or 503 for a lone item). That evidence
        is spent here: the same item running out again before anything as
        large fits is then too large (memory may have shrunk for good)."""
        below = max(1, padded_elements // 2)
        self.limit = below if self.limit is None else min(self.limit, below)
        self._fitted = 0
        self._free_when_out = self._free_bytes()
        transient, self.largest_fit = padded_elements <= self.largest_fit, 0
        return transient

    def fitted(self, padded_elements: int = 0) -> bool:
        """A batch of this size fit; True when the limit just went up."""
        self.largest_fit = max(self.largest_fit, padded_elements)
        if self.limit is None:
            return False
        self._fitted += 1
        if self._fitted < self.GROW_AFTER:
            return False
        self._fitted = 0
        if self._free_when_out is not None:
            free = self._free_bytes()
            if free is not None and free < self._free_when_out * self.GROWTH:
                return False  # no more room than when it ran out
        self.limit = int(self.limit * self.GROWTH) + 1
        return True
