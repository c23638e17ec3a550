"""One rank of tests/test_tensor_parallel.py's compiled cases: DTensor arguments under torch.compile take
lockstep's sharding rules (the eager ones), on a gloo world.

* the row-wise ops (tp_worker.run_ops) on a Shard(0) batch, one ``fullgraph=True`` graph; a row-wise linear's
  gradients, compiled;
* per-block compile (``module.compile()``, TorchTitan's setup) of a small MLP block of ``hal.linear`` modules
  under ``parallelize_module``: ColwiseParallel up + RowwiseParallel down (exact policy), and ColwiseParallel up +
  a ColwiseParallel down gathering its output (strict policy), forward and gradients; of a patched tiny Llama's
  decoder layers;
* refusals: a strict RowwiseParallel linear (eager and compiled), the float partial sums' opt-in (a graph traced
  under it refuses a call made outside it), a feature-dim ``Shard(1)`` of rms_norm.

Every case records its result or its error (class, message), so a rank never dies on one case.
Run as ``python tests/dist/tp_compile_worker.py RANK WORLD PORT OUT_DIR``; writes ``OUT_DIR/rank{RANK}.pt``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker as W  # noqa: E402

WIDTH = 64  # the block's in / out width; hidden: W.INTER (80 per rank, not a multiple of the strict K tile)


class HalLinear(torch.nn.Linear):
    """An nn.Linear whose forward is ``hal.linear`` under ``spec`` (torch's parallel styles take it as a Linear)."""

    def __init__(self, n_in: int, n_out: int, spec):
        super().__init__(n_in, n_out)
        self.spec = spec

    def forward(self, x):
        import hal
        return hal.linear(x, self.weight, self.bias, spec=self.spec)


class Block(torch.nn.Module):
    """down(silu(up(x))): the MLP shape tensor parallelism splits (up's outputs, down's reduction)."""

    def __init__(self, spec, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.up, self.down = HalLinear(WIDTH, W.INTER, spec), HalLinear(W.INTER, WIDTH, spec)

    def forward(self, x):
        import hal
        return self.down(hal.silu(self.up(x)))


def block_input() -> torch.Tensor:
    return torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(5))


def block_plan(kind: str) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if kind == "rowwise":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {"up": ColwiseParallel(), "down": ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())}


def _error(e: BaseException) -> tuple[str, str, bool]:
    import hal
    return type(e).__name__, str(e), isinstance(e, hal.UnsupportedError)


def attempt(res: dict, name: str, f):
    """res[name] = f()'s result, or res["error/" + name] = (class name, message, is lockstep's UnsupportedError)."""
    try:
        res[name] = f()
    except Exception as e:  # noqa: BLE001 (recorded, the test reads it)
        res["error/" + name] = _error(e)


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
        res = {}

        # 1. the row-wise ops on a Shard(0) batch: eager, and one fullgraph graph
        plain = W.op_inputs()
        weights = {"w", "b", "norm_w"}
        dt = {k: distribute_tensor(v, mesh, [Replicate() if k in weights else Shard(0)]) for k, v in plain.items()}
        for k, v in W.run_ops(dt).items():
            res[f"eager/{k}"] = v.to_local()
        torch._dynamo.reset()
        attempt(res, "compiled/ops", lambda: {k: (v.to_local(), str(v.placements))
                                              for k, v in torch.compile(W.run_ops, fullgraph=True)(dt).items()})

        # placements are guarded: the graph traced for a Shard(0) x, given a replicated x, retraces under the rule
        torch._dynamo.reset()
        linear = torch.compile(lambda x, w, b: hal.linear(x, w, b), fullgraph=True)
        x_rep = distribute_tensor(plain["x"], mesh, [Replicate()])
        attempt(res, "compiled/linear_shard0_then_replicate",
                lambda: [(y.to_local(), str(y.placements)) for y in (linear(dt["x"], dt["w"], dt["b"]),
                                                                     linear(x_rep, dt["w"], dt["b"]))])

        # 2. a row-wise linear's gradients (replicated weight: Partial), eager and compiled
        def grads(f):
            x, w = (dt[k].detach().requires_grad_() for k in ("x", "w"))
            f(x, w, dt["b"]).sum().backward()
            return {"x": x.grad.to_local(), "w": w.grad.to_local(), "w_placements": str(w.grad.placements)}
        res["eager/grads"] = grads(hal.linear)
        torch._dynamo.reset()
        attempt(res, "compiled/grads",
                lambda: grads(torch.compile(lambda x, w, b: hal.linear(x, w, b), fullgraph=True)))

        # 3. per-block compile of a TP block: eager, compiled, compiled fullgraph
        x = block_input()
        for name, spec, kind in (("exact/rowwise", ExactMatmulSpec(slices=4), "rowwise"),
                                 ("strict/colwise", None, "colwise")):
            block = Block(spec)
            parallelize_module(block, mesh, block_plan(kind))
            with torch.no_grad():
                attempt(res, f"eager/block/{name}", lambda: block(x))
                for fullgraph in (False, True):
                    torch._dynamo.reset()
                    compiled = Block(spec)
                    parallelize_module(compiled, mesh, block_plan(kind))
                    compiled.compile(fullgraph=fullgraph)
                    attempt(res, f"compiled/block/{name}/fullgraph={fullgraph}", lambda: compiled(x))

            # training: the block's gradients (x's and every parameter's local shard), eager and compiled
            def block_grads(compile_it: bool):
                torch._dynamo.reset()
                block = Block(spec)
                parallelize_module(block, mesh, block_plan(kind))
                if compile_it:
                    block.compile()
                xg = x.clone().requires_grad_()
                block(xg).pow(2).sum().backward()
                return [xg.grad] + [p.grad.to_local() for p in block.parameters()]
            res[f"eager/block_grads/{name}"] = block_grads(False)
            attempt(res, f"compiled/block_grads/{name}", lambda: block_grads(True))

        # 4. a patched tiny Llama's decoder layers compiled one by one (ColwiseParallel MLPs, strict policy)
        model = W.tiny_llama()
        lt.apply(model)
        parallelize_module(model, mesh, W.plan("colwise"))
        for layer in model.model.layers:
            layer.compile()
        torch._dynamo.reset()
        with torch.no_grad():
            attempt(res, "compiled/llama_layers", lambda: model(input_ids=W.input_ids(), use_cache=False).logits)

        # 5. a strict RowwiseParallel linear: refused eagerly and compiled; the opt-in is read when the graph runs
        xs = torch.randn(5, W.INTER, generator=torch.Generator().manual_seed(6)).chunk(world, -1)[rank]
        block = Block(None).down
        parallelize_module(block, mesh, block_plan("rowwise")["down"])
        with torch.no_grad():
            attempt(res, "eager/strict_rowwise", lambda: block(xs))
            torch._dynamo.reset()
            compiled = torch.compile(block, fullgraph=True)
            attempt(res, "compiled/strict_rowwise", lambda: compiled(xs))
            with tp.float_partial_sums():
                res["eager/strict_rowwise_opt_in"] = block(xs)
                torch._dynamo.reset()
                attempt(res, "compiled/strict_rowwise_opt_in", lambda: compiled(xs))
            attempt(res, "compiled/strict_rowwise_after_opt_in", lambda: compiled(xs))

        # 6. a placement refused by name (the feature dim of rms_norm), eagerly and compiled (fullgraph)
        x_feat = distribute_tensor(plain["x"], mesh, [Shard(1)])
        attempt(res, "eager/rms_norm_shard1", lambda: hal.rms_norm(x_feat, dt["norm_w"]))
        torch._dynamo.reset()
        attempt(res, "compiled/rms_norm_shard1",
                lambda: torch.compile(lambda x, w: hal.rms_norm(x, w), fullgraph=True)(x_feat, dt["norm_w"]))
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
