"""One rank of tests/test_fsdp2.py: a tiny HF Llama under FSDP2 ``fully_shard`` on a gloo world.

Run as ``python tests/dist/fsdp2_worker.py RANK WORLD PORT OUT_DIR``; writes ``OUT_DIR/rank{RANK}.pt``
with what the test compares against single-process runs. Rank r takes rows ``r*ROWS:(r+1)*ROWS`` of
``batch()`` (data parallel), so every comparison is "this rank's rows" vs "the same rows in the
single-process full batch" -- a trainer's micro-batch vs the sampler's batch.
"""
from __future__ import annotations

import sys

import torch

ROWS, SEQ = 2, 12     # rows per rank, tokens per row
LR = 1e-2


def batch(world: int) -> torch.Tensor:
    from hal.integrations.transformers.testing import VOCAB
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (world * ROWS, SEQ), generator=g)


def control_batch(world: int) -> torch.Tensor:
    """One 2-token row per rank (a rank's linears see 2 rows, the single process 2 * world): the negative controls'
    batch, small so that the stock models add little to the run."""
    from hal.integrations.transformers.testing import VOCAB
    return torch.randint(0, VOCAB, (world, 2), generator=torch.Generator().manual_seed(2))


def optimizer(params):
    """The step both sides take (AdamW, the per-parameter loop: elementwise on a shard or a full tensor)."""
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def build(patched: bool, stock_modules: tuple[str, ...] = ()):
    """The tiny Llama of the test (fp32), patched by lockstep unless ``patched`` is False; ``stock_modules``:
    names of modules whose lockstep forward is removed again (negative controls)."""
    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_model
    lt.register()
    model = tiny_model("llama", attn_implementation="lockstep" if patched else "sdpa")
    if patched:
        lt.apply(model)
        for name in stock_modules:
            model.get_submodule(name).__dict__.pop("forward")
    return model


def shard(model, mp_policy=None):
    from torch.distributed.fsdp import fully_shard
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a plain tensor (collective: all ranks call it)."""
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()
            if hasattr(v, "full_tensor")}


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.set_num_threads(1)  # the single-process reference runs with one thread too (backward is stock math)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ids = batch(world)[rank * ROWS:(rank + 1) * ROWS]
        res = {}

        # 1. patched fp32: forward, backward, optimizer step, forward again
        model = shard(build(patched=True))
        opt = optimizer(model.parameters())  # before any forward: FSDP2 keeps the root unsharded after one
        with torch.no_grad():
            res["logits"] = model(input_ids=ids).logits
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            res["logits_after_step"] = model(input_ids=ids).logits
        res["params_after_step"] = full_state(model)

        # 2. patched, mixed precision (bf16 compute, fp32 master weights): forward; FSDP2's default also casts
        # every float forward input of a sharded module to bf16 (the float32 rotary tables between layers too)
        for key, cast in (("logits_bf16", True), ("logits_bf16_nocast", False)):
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
            model = shard(build(patched=True), mp)
            with torch.no_grad():
                res[key] = model(input_ids=ids).logits

        # 3. negative controls on the short batch: stock transformers, and a patched model with one linear left
        # stock; the patched model on the same batch is the positive check
        short = control_batch(world)[rank:rank + 1]
        for key, m in (("patched", build(True)), ("stock", build(patched=False)),
                       ("one_stock", build(True, ("model.layers.0.mlp.down_proj",)))):
            m = shard(m)
            with torch.no_grad():
                res[f"short_{key}"] = m(input_ids=short).logits
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
