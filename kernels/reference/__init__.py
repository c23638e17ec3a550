"""Reference kernels: the strict specs written out in plain torch elementwise operations.

No BLAS and no library reduction appears here: every reduction is a loop in the spec's order.
The loops run over the reduction axis only; rows, columns, heads and batch are vectorised,
which is free (docs/design.md, principle 2: only reduction-axis tiling changes bits).
"""
