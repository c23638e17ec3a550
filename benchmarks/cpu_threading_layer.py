"""The cpu backend at 2 threads with numba's threading layer left to its default and set to workqueue
(NUMBA_THREADING_LAYER), stock torch in the same process. The backend now runs on its own threads
(kernels/cpu/pool.py) and starts no numba layer ("layer=unused"): the two lines should match. Before the
pool its prange drivers ran on numba's layer, and OpenMP's spinning workers made linear 3x slower.

    python -m benchmarks.cpu_threading_layer

Each layer runs in its own interpreter (numba's layer is chosen once per process): hal.linear
128x1024x1024 and hal.softmax 32x32768, float32, 2 threads, median of 15 calls after 2 warm-ups.
"""
from __future__ import annotations

import os
import subprocess
import sys

_CHILD = r'''
import os, statistics, time, torch, numba, hal, torch.nn.functional as F
torch.set_num_threads(2)
x, w = torch.randn(128, 1024), torch.randn(1024, 1024)
s = torch.randn(32, 32768)
def t(fn, n=15):
    fn(); fn()
    r = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); r.append(time.perf_counter() - t0)
    return statistics.median(r) * 1e3
a = t(lambda: hal.linear(x, w, backend="cpu")); b = t(lambda: F.linear(x, w))
c = t(lambda: hal.softmax(s, backend="cpu")); d = t(lambda: torch.softmax(s, -1))
try:
    layer = numba.threading_layer()
except ValueError:  # no numba parallel region ran in this process
    layer = "unused"
print(f"env={os.environ.get('NUMBA_THREADING_LAYER', 'default'):<10} layer={layer:<10} linear 128x1024x1024 {a:7.2f} ms (stock {b:7.2f}, ratio {a / b:.1f}); "
      f"softmax 32x32768 {c:6.2f} ms (stock {d:6.2f}, ratio {c / d:.1f})")
'''


def main() -> None:
    for layer in (None, "workqueue"):
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
        if layer:
            env["NUMBA_THREADING_LAYER"] = layer
        subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True)


if __name__ == "__main__":
    main()
