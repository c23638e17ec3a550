"""Triton kernels of the strict specs (imported only by hal.backends.triton, never by ``import hal``).

strict_math: device functions (fma, lsm1 exp/log, div_rn, sqrt_rn, integer RNE output rounding,
canonical NaN) bit for bit kernels/reference/strict_math.py; launch: the one way every strict
kernel is launched (fp fusion off, interpreter sanity check). One module per op family beside them.
"""
