"""hal.distributed under the exact policy: 1, 2 and 4 gloo processes on this machine give the same
bits (row-parallel: K sharded, uneven shards included; column-parallel: N sharded), equal to the
unsharded reference; the stock row-parallel linear (float32 partials + all-reduce) is caught."""
from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hal
from hal.conformance.bits import first_divergence
from hal.spec import ExactMatmulSpec

M, K, N = 5, 1003, 8
SPEC = ExactMatmulSpec(slices=4)
DTYPES = (torch.float32, torch.bfloat16)

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-6, 6, (M, K), generator=g))).to(dtype)
    x[:, 7] *= 1000                   # an outlier channel: it sets the row scales, on one rank only
    x[1] = 0                          # a zero row
    x[2, 900] = float("inf")          # a non-finite value in one shard only
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    w[3, 5] = 0.0
    bias = torch.randn(N, generator=g).to(dtype)
    return x, w, bias


def _shards(k, world):
    """Uneven K cuts (the last rank gets the rest)."""
    base = [k // world + (7 if r == 0 and world > 1 else 0) for r in range(world)]
    base[-1] = k - sum(base[:-1])
    cuts = [0]
    for b in base:
        cuts.append(cuts[-1] + b)
    return cuts


def _worker(rank, world, port, out_path):
    """One 4-process gloo world; TP = 1, 2, 4 are its subgroups {0}, {0, 1}, {0, 1, 2, 3}."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from hal import distributed as hd
        res = {}
        for tp in (1, 2, 4):
            group = dist.new_group(list(range(tp)))  # every rank takes part in creating every group
            if rank >= tp:
                continue
            for dtype in DTYPES:
                x, w, bias = _inputs(dtype)
                c = _shards(K, tp)
                xs, ws = x[:, c[rank]:c[rank + 1]], w[:, c[rank]:c[rank + 1]]
                res[f"{tp}/row/{dtype}"] = hd.row_parallel_linear(xs, ws, bias, SPEC, group=group)
                res[f"{tp}/stock-row/{dtype}"] = hd.stock_row_parallel_linear(xs, ws, bias, group=group)
                nr = N // tp
                res[f"{tp}/col/{dtype}"] = hd.column_parallel_linear(x, w[rank * nr:(rank + 1) * nr],
                                                                     bias[rank * nr:(rank + 1) * nr], SPEC, group=group)
        if rank == 0:
            torch.save(res, out_path)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp") / "results.pt")
    world, deadline = 4, 150.0
    ctx = mp.start_processes(_worker, args=(world, _free_port(), out), nprocs=world, join=False, start_method="spawn")
    t0 = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - t0 > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {world} gloo workers did not finish within {deadline} s")
    res = torch.load(out)
    return {tp: {k.split("/", 1)[1]: v for k, v in res.items() if k.startswith(f"{tp}/")} for tp in (1, 2, 4)}


def test_exact_tp_degrees_give_identical_bits_and_the_reference(results):
    for dtype in DTYPES:
        x, w, bias = _inputs(dtype)
        want = hal.linear(x, w, bias, spec=SPEC, backend="reference")
        for world in (1, 2, 4):
            for kind in ("row", "col"):
                d = first_divergence(f"TP={world} {kind} {dtype}", want, results[world][f"{kind}/{dtype}"])
                assert d is None, str(d)
        assert torch.isinf(want[2]).all() or torch.isnan(want[2]).any()  # the inf in one shard reached row 2


def test_stock_row_parallel_is_caught(results):
    """The same comparison across TP degrees catches float32 partials + all-reduce."""
    caught = [first_divergence(f"stock TP=1 vs {w}", results[1]["stock-row/torch.float32"],
                               results[w]["stock-row/torch.float32"]) for w in (2, 4)]
    assert all(d is not None for d in caught), caught


def test_bad_arguments_are_rejected_before_communication():
    from hal import distributed as hd
    x, w, bias = _inputs(torch.float32)
    with pytest.raises(hal.SpecError, match="ExactMatmulSpec"):
        hd.row_parallel_linear(x, w, bias, hal.spec.MatmulSpec())
    with pytest.raises(hal.InputError, match="x.shape"):
        hd.row_parallel_linear(x[:, :10], w, bias, SPEC)
    with pytest.raises(hal.InputError, match="dtype"):
        hd.column_parallel_linear(x, w.double(), bias, SPEC)
