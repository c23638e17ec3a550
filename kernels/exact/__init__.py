"""The ``exact`` matmul policy: integer-exact accumulation (docs/exact_matmul.md).

``core`` holds the arithmetic every exact kernel shares (slicing, the wide combine, the one rounding,
NaN/Inf); ``cpu`` computes the slice products with ``torch._int_mm``. The readable golden source is
``hal.kernels.reference.exact_matmul`` (int64 torch matmuls).
"""
