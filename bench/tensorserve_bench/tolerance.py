"""How far a served output may be from the same model's output computed
alone on the CPU in float32, by the dtype the model computes in on the
serving device.

The bound is ``rtol * max(1, |largest expected value|)``, on the largest
absolute difference over every element compared:

    float32   1e-4  float32 on another device or in another batch only
                    reorders sums (differences of 1e-7..1e-5 seen), while
                    TF32 rounds each product's operands to 10 bits (about
                    3e-4 relative per dot product, 1e-3 at the worst
                    element) and bfloat16 to 7 bits (about 4e-3): a float32
                    model silently run in either fails this bound.
    float16   1e-2  10-bit mantissa (unit roundoff 4.9e-4) through up to 12
                    post-norm blocks and a softmax: a few 1e-3 at the worst
                    element of a BERT-base-size encoder.
    bfloat16  5e-2  7-bit mantissa (unit roundoff 3.9e-3), 8 times float16's.
"""

from __future__ import annotations

RTOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def tolerance(dtype: str, scale: float) -> float:
    """The largest absolute error allowed for outputs of magnitude ``scale``
    from a model computing in ``dtype`` (a name of ``RTOL``)."""
    try:
        rtol = RTOL[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(RTOL)}") from None
    return rtol * max(1.0, scale)
