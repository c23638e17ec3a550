"""numba kernels of the `cpu` backend: the strict specs' exact arithmetic, compiled (see docs/cpu_backend.md)."""
