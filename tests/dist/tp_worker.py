"""One rank of tests/test_tensor_parallel.py: DTensor inputs to lockstep's row-wise ops, and a patched tiny
Llama under torch's ``parallelize_module`` (ColwiseParallel / RowwiseParallel MLPs), on a gloo world.

Run as ``python tests/dist/tp_worker.py RANK WORLD PORT OUT_DIR``; writes ``OUT_DIR/rank{RANK}.pt``.
"""
from __future__ import annotations

import sys

import torch

ROWS = 6                    # rows of the row-wise op inputs (Shard(0): 3 per rank)
H, V, INTER = 64, 128, 160  # hidden, vocab, MLP width: 80 per rank, not a multiple of the strict 64-wide K tile
SEQ = 10
# A second linear with a K reduction of several 64-wide strict tiles: at K = 64 (one tile, one fma chain) a CPU
# BLAS that runs one fma chain per output (AVX-512 MKL) gives lockstep's bits, so only a longer K lets the stock
# control below show that the comparison catches a stock F.linear on any CPU. 200: three tiles and a partial one.
LONG_K = 200
# the linears of run_ops and their (x, weight, bias) inputs: the stock control runs F.linear on the same ones
LINEARS = {"linear": ("x", "w", "b"), "linear_long_k": ("xk", "wk", "b")}
WEIGHTS = {"w", "wk", "b", "norm_w"}  # op_inputs replicated on every rank; the others are Shard(0)


def op_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ang = r(ROWS, 4, 8)
    return {"x": r(ROWS, H), "w": r(V, H) * H ** -0.5, "b": r(V), "norm_w": r(H), "res": r(ROWS, H), "gate": r(ROWS, H),
            "tokens": torch.randint(0, V, (ROWS,), generator=g), "q": r(ROWS, 4, 2, 16), "cos": ang.cos(),
            "sin": ang.sin(),  # the long-K linear's inputs are drawn last, so the inputs above keep their values
            "xk": r(ROWS, LONG_K), "wk": r(V, LONG_K) * LONG_K ** -0.5}


def run_ops(t: dict) -> dict[str, torch.Tensor]:
    """The row-wise ops on the tensors ``t`` (plain or DTensor); the test runs this on plain tensors too."""
    import hal
    y, h = hal.rms_norm(t["x"], t["norm_w"], 1e-6, residual=t["res"])
    return {**{op: hal.linear(*(t[k] for k in keys)) for op, keys in LINEARS.items()},
            "rms_norm": y, "rms_norm_h": h,
            "softmax": hal.softmax(t["x"], -1), "log_softmax": hal.log_softmax(t["x"], -1),
            "silu_mul": hal.silu_mul(t["gate"], t["x"]),
            "token_logprobs": hal.token_logprobs(t["x"], t["w"], t["tokens"]),
            "apply_rotary": hal.apply_rotary(t["q"], t["cos"][:, :, None, :], t["sin"][:, :, None, :])}


def tiny_llama(seed: int = 0):
    import transformers as tf
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_config
    lt.register()
    cfg = tiny_config("llama")
    cfg.intermediate_size = INTER
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tf.LlamaForCausalLM(cfg).eval()


def input_ids() -> torch.Tensor:
    return torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(4))


PLANS = ("rowwise", "colwise")  # MLP down_proj: RowwiseParallel, or ColwiseParallel gathering its input and output


def plan(kind: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    down = RowwiseParallel() if kind == "rowwise" else ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
    return {f"model.layers.{i}.mlp.{name}": style for i in range(2)
            for name, style in (("gate_proj", ColwiseParallel()), ("up_proj", ColwiseParallel()), ("down_proj", down))}


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    import hal
    from hal import tensor_parallel as tp
    from hal.integrations import transformers as lt
    from hal.spec import ExactMatmulSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        res, errors = {}, {}

        # 1. row-wise ops on a Shard(0) batch with replicated weights
        plain = op_inputs()
        dt = {k: distribute_tensor(v, mesh, [Replicate() if k in WEIGHTS else Shard(0)]) for k, v in plain.items()}
        for k, v in run_ops(dt).items():
            res[f"op/{k}"] = v.to_local()
            res[f"placements/{k}"] = str(v.placements)
        for op, keys in LINEARS.items():  # negative control: stock F.linear on the same DTensors
            res[f"op_stock/{op}"] = torch.nn.functional.linear(*(dt[k] for k in keys)).to_local()
        res["op_grad/weight_placements"] = str(_weight_grad(dt, hal).placements)
        x_feat = distribute_tensor(plain["x"], mesh, [Shard(1)])
        w_shard = distribute_tensor(plain["norm_w"], mesh, [Shard(0)])
        refusals = {"rms_norm x Shard(1)": lambda: hal.rms_norm(x_feat, dt["norm_w"]),
                    "rms_norm weight Shard(0)": lambda: hal.rms_norm(dt["x"], w_shard),
                    "linear plain weight": lambda: hal.linear(dt["x"], plain["w"]),
                    "softmax Shard(1)": lambda: hal.softmax(x_feat, -1)}
        for name, f in refusals.items():
            try:
                f()
                errors[name] = None
            except hal.UnsupportedError as e:
                errors[name] = str(e)

        # 2. parallelize_module on a patched tiny Llama's MLPs
        ids = input_ids()
        cases = {"exact/rowwise": (ExactMatmulSpec(slices=4), "rowwise"), "strict/colwise": (None, "colwise"),
                 "exact/colwise": (ExactMatmulSpec(slices=4), "colwise"), "strict/rowwise": (None, "rowwise")}
        for name, (spec, kind) in cases.items():
            model = tiny_llama()
            lt.apply(model, matmul_spec=spec)
            parallelize_module(model, mesh, plan(kind))
            with torch.no_grad():
                if name == "strict/rowwise":  # refused, then the opt-in float partial sums: the negative control
                    try:
                        model(input_ids=ids)
                        errors[name] = None
                    except hal.UnsupportedError as e:
                        errors[name] = str(e)
                    with tp.float_partial_sums():
                        res[f"tp/{name}"] = model(input_ids=ids).logits
                else:
                    res[f"tp/{name}"] = model(input_ids=ids).logits
            if name == "exact/rowwise":  # training under TP runs (the backward is stock float32 math)
                model(input_ids=ids, labels=ids).loss.backward()
                g = model.model.layers[0].mlp.down_proj.weight.grad
                res["tp_grad/down_proj"] = f"{type(g).__name__} {g.placements} finite={bool(g.to_local().isfinite().all())}"
        res["errors"] = errors
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _weight_grad(dt, hal):
    """A replicated weight's gradient after a Shard(0) batch's backward (Partial: each rank saw its rows)."""
    w = dt["w"].detach().requires_grad_()
    hal.linear(dt["x"], w).sum().backward()
    return w.grad


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
