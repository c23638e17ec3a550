"""The cost of the exact policy's content stamp (hal/weight_watch.py) against the exact matmul itself.

    python -m benchmarks.exact_stamp --threads 1

Every use of a prepared weight hashes its bits (once per op call) so that no write goes unseen.
Two tables, one process, medians of repeated calls:

* per weight: the hash of one weight vs ``hal.linear`` with that weight prepared (cpu backend,
  exact s = 4) at M = 1 and M = 32 rows, for tiny and realistic sizes (a 7B model's 4096 x 4096
  attention projection and 11008 x 4096 MLP weight), float32 and bfloat16; the ratio is the
  stamp's share of the call.
* per forward: a patched Llama (benchmarks/hf_exact.py's tiny and small sizes) under the exact
  patch as shipped vs the same patch with the hash left out (the old, unsafe version-counter
  check: what the stamp costs), and stock torch of the same run.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.exact import median_time
from hal.spec import ExactMatmulSpec

SPEC = ExactMatmulSpec(slices=4)
WEIGHTS = {"tiny 64x64": (64, 64), "small 512x512": (512, 512), "7B attn 4096x4096": (4096, 4096),
           "7B mlp 11008x4096": (11008, 4096)}


def weight_rows(names, dtypes):
    import hal
    from hal import weight_watch as stamp
    for name in names:
        n, k = WEIGHTS[name]
        for dtype in dtypes:
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
            ew = hal.exact_weight(w, spec=SPEC, backend="cpu")
            t_hash = median_time(lambda: stamp.content_hash(w), 5, 0.3)
            for m in (1, 32):
                x = torch.randn(m, k, generator=g).to(dtype)
                t_lin = median_time(lambda: hal.linear(x, ew, spec=SPEC, backend="cpu"), 3, 0.3)
                yield name, dtype, m, t_hash, t_lin


def forward_rows(sizes, tokens, dtype):
    from benchmarks.hf_exact import model
    from hal import weight_watch
    from hal.integrations import transformers as lt
    lt.register()
    for size in sizes:
        m = model(size, dtype)
        x = torch.randint(1, m.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))

        def fwd():
            m(input_ids=x, use_cache=False)

        stock = median_time(fwd, 3, 1.0)
        with lt.patch(m, matmul_spec=SPEC) as patch:
            shipped = median_time(fwd, 3, 1.0)
            real = weight_watch.content_hash
            weight_watch.content_hash = lambda t: 0  # the quick stamp only: blind to fused steps, timing only
            patch.matmul.clear()  # re-stamped (with 0) by median_time's untimed first call
            try:
                quick_only = median_time(fwd, 3, 1.0)
            finally:
                weight_watch.content_hash = real
        yield size, stock, shipped, quick_only


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| weight | dtype | M | stamp (hash) µs | exact linear µs | stamp / linear |")
    print("|---|---|---|---|---|---|")
    for name, dtype, m, t_hash, t_lin in weight_rows(args.weights, (torch.float32, torch.bfloat16)):
        print(f"| {name} | {str(dtype)[6:]} | {m} | {t_hash * 1e6:.0f} | {t_lin * 1e6:.0f} | {t_hash / t_lin:.1%} |",
              flush=True)
    print()
    print(f"| model, [1, {args.tokens}] float32 | stock ms | exact ms (shipped) | exact ms, hash left out | "
          "stamp ms / forward | stamp share | exact vs stock |")
    print("|---|---|---|---|---|---|---|")
    for size, stock, shipped, quick in forward_rows(args.sizes, args.tokens, torch.float32):
        print(f"| {size} llama | {stock * 1e3:.2f} | {shipped * 1e3:.2f} | {quick * 1e3:.2f} | "
              f"{(shipped - quick) * 1e3:.2f} | {(shipped - quick) / shipped:.1%} | {shipped / stock:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
