"""Every way a trainer or a weight sync changes a weight is seen before the next exact call.

For each write -- every torch.optim optimizer in its loop, foreach and fused forms, ``copy_`` under
no_grad, ``.data.copy_``, ``load_state_dict``, ``.data =`` rebound twice back onto the original
address, a real 2-process gloo ``broadcast`` into the parameter -- a prepared ``ExactWeight`` is
refused (InputError) and the HF exact patch re-slices and gives a freshly patched model's logits
bit for bit. Negative controls: the old ``(_version, data_ptr)`` stamp misses the fused steps and
the rebinding (computed side by side in the tests), and a patch that never re-slices gives other
logits. Weights made under ``torch.inference_mode()`` (no version counter) work: ``exact_weight``
and ``lt.patch(..., matmul_spec=exact)`` + ``generate``.
"""
from __future__ import annotations

import inspect
import socket
import time

import pytest
import torch

import hal
from hal.kernels.exact.prepared import ExactWeight
from hal.spec import ExactMatmulSpec
from test_exact_matmul import _spread, assert_bits

pytestmark = pytest.mark.usefixtures("one_thread")

S4 = ExactMatmulSpec(slices=4)
OLD_STAMP = lambda t: (t._version, t.data_ptr())  # noqa: E731  the stamp before the content stamp


def _optimizer_forms():
    """(name, form, kwargs) for every torch.optim optimizer that steps dense 2-D weights, in each form it has."""
    out = []
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        if name == "SparseAdam":  # sparse gradients only (embeddings), never a linear's weight
            continue
        params = inspect.signature(cls.__init__).parameters
        forms = [(f, {k: True} if k != "loop" else {"foreach": False})
                 for f, k in (("loop", "loop"), ("foreach", "foreach"), ("fused", "fused"))
                 if k in params or (k == "loop" and "foreach" in params)]
        out += [(name, f, kw) for f, kw in forms] or [(name, "default", {})]
    return out


OPTIMIZERS = _optimizer_forms()
FUSED = {"Adam", "AdamW", "Adagrad", "SGD"}


def test_the_optimizer_matrix_is_complete():
    """The matrix the tests below run over is every form of every optimizer (none silently dropped)."""
    got = {(n, f) for n, f, _ in OPTIMIZERS}
    assert {(n, "fused") for n in FUSED} <= got
    assert {(n, f) for n in FUSED | {"RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop"}
            for f in ("loop", "foreach")} <= got
    assert ("LBFGS", "default") in got


def _step(opt_name, kw, params, loss_fn):
    cls = getattr(torch.optim, opt_name)
    opt = cls(params, lr=0.05, **kw, **({"max_iter": 1} if opt_name == "LBFGS" else {}))  # one step: one update
    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss
    if opt_name == "LBFGS":
        opt.step(closure)
    else:
        closure()
        opt.step()


# ---------------------------------------------------------------- the hash itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_hash_definitions_agree_and_see_one_bit(dtype):
    """numba's hash == the torch definition (contiguous, transposed, inference tensors); flipping any one
    bit (sign, lowest mantissa), swapping two values or moving a value changes it."""
    from hal import weight_watch as stamp
    from hal.kernels.cpu import weight_hash
    w = _spread((37, 70), dtype, 3)
    with torch.inference_mode():
        inf_w = w.clone()
    big = _spread((2100, 520), dtype, 4)  # the threaded pass (lockstep's pool)
    assert stamp.lanes(big).numel() >= weight_hash._THREADS_FROM
    for t in (w, w.T, w[5:20], inf_w, big):
        assert stamp.content_hash(t) == stamp.hash_torch(stamp.lanes(t))
    h = stamp.content_hash(w)
    ibits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    top = torch.iinfo(ibits).min  # the sign bit
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        i, j = (int(v) for v in torch.randint(0, 37 * 70, (2,), generator=g))
        for mask in (1, top):
            flipped = w.clone()
            flipped.view(ibits).view(-1)[i] ^= mask
            assert stamp.content_hash(flipped) != h
        if w.view(-1)[i] != w.view(-1)[j]:
            swapped = w.clone().view(-1)
            swapped[i], swapped[j] = w.view(-1)[j], w.view(-1)[i]
            assert stamp.content_hash(swapped.view(37, 70)) != h
    assert stamp.content_hash(w.roll(1, 1)) != h


# ---------------------------------------------------------------- prepared ExactWeight: refused after every write


def _weight_and_x():
    w = _spread((9, 70), torch.float32, 1)
    return torch.nn.Parameter(w.clone()), _spread((3, 70), torch.float32, 2)


@pytest.mark.parametrize("opt_name, form, kw", OPTIMIZERS, ids=[f"{n}-{f}" for n, f, _ in OPTIMIZERS])
def test_every_optimizer_form_makes_exact_weight_stale(opt_name, form, kw):
    p, x = _weight_and_x()
    ew = hal.exact_weight(p, spec=S4)
    hal.linear(x, ew, spec=S4, backend="reference")  # fresh: fine
    before, old = p.detach().clone(), OLD_STAMP(p)
    _step(opt_name, kw, [p], lambda: hal.linear(x, p, spec=S4, backend="reference").square().sum())
    assert not torch.equal(before.view(torch.int32), p.detach().view(torch.int32)), "the step changed nothing"
    if form == "fused":  # negative control: the old stamp does not see a fused step
        assert OLD_STAMP(p) == old
    with pytest.raises(hal.InputError, match="weight: weight changed since exact_weight"):
        hal.linear(x, ew, spec=S4, backend="reference")


def _rebind_twice(p, new):
    """``p.data = t`` twice, the second time onto p's original storage holding other bits: the address and
    the version counter are those of the stamp (what an allocator handing back the old block does)."""
    orig = p.data
    p.data = torch.zeros_like(orig)
    orig.copy_(new)  # orig is no longer p's data: p's version counter does not move
    p.data = orig


WRITES = {
    "copy_no_grad": lambda p, new: torch.no_grad()(p.copy_)(new),
    "data_copy_": lambda p, new: p.data.copy_(new),
    "load_state_dict": lambda p, new: _Holder(p).load_state_dict({"w": new}),
    "data_rebind_twice": _rebind_twice,
}
UNCOUNTED = {"data_copy_", "data_rebind_twice"}  # the writes the old stamp missed


class _Holder(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.w = p


@pytest.mark.parametrize("how", sorted(WRITES))
def test_every_write_makes_exact_weight_stale(how):
    p, x = _weight_and_x()
    new = _spread((9, 70), torch.float32, 5)
    ew = hal.exact_weight(p, spec=S4)
    old, ptr = OLD_STAMP(p), p.data_ptr()
    WRITES[how](p, new)
    assert torch.equal(p.detach().view(torch.int32), new.view(torch.int32)) and p.data_ptr() == ptr
    if how in UNCOUNTED:
        assert OLD_STAMP(p) == old  # negative control: the old stamp collides
    with pytest.raises(hal.InputError, match="weight changed since exact_weight"):
        hal.linear(x, ew, spec=S4)
    assert_bits(how, hal.linear(x, new, spec=S4), hal.linear(x, hal.exact_weight(p, spec=S4), spec=S4))


def test_unchanged_weight_stays_fresh_and_one_check_per_call(monkeypatch):
    """No write, no refusal (also after ``.data = `` the same tensor); one hal.linear hashes the weight once."""
    p, x = _weight_and_x()
    ew = hal.exact_weight(p, spec=S4)
    p.data = p.data
    from hal import weight_watch
    calls = []
    real = weight_watch.content_hash
    monkeypatch.setattr(weight_watch, "content_hash", lambda t: calls.append(1) or real(t))
    for be in ("reference", "cpu"):
        calls.clear()
        assert_bits(be, hal.linear(x, p.detach(), spec=S4, backend=be), hal.linear(x, ew, spec=S4, backend=be))
        assert len(calls) == 1, be


def test_inference_mode_weights():
    """Inference tensors have no version counter: prepared, used, and a write to them is still refused."""
    x = _spread((3, 70), torch.bfloat16, 2)
    with torch.inference_mode():
        w = _spread((9, 70), torch.bfloat16, 1)
        ew = hal.exact_weight(w, spec=S4)
        assert_bits("inference", hal.linear(x, w, spec=S4), hal.linear(x, ew, spec=S4))
        w.mul_(2)
        with pytest.raises(hal.InputError, match="weight changed"):
            hal.linear(x, ew, spec=S4)
    assert w.is_inference()
    with pytest.raises(hal.InputError, match="weight changed"):  # and outside inference mode
        hal.linear(x, ew, spec=S4)


# ---------------------------------------------------------------- torch.distributed: a broadcast into the parameter


def _hf_ids():
    from hal.integrations.transformers.testing import VOCAB
    return torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_worker(rank, world, port, out_path):
    import torch.distributed as dist

    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_model
    lt.register()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = {}
        p, x = _weight_and_x()
        if rank == 0:
            with torch.no_grad():
                p.mul_(-3)
        ew = hal.exact_weight(p, spec=S4)
        old = OLD_STAMP(p)
        dist.broadcast(p.data, src=0)  # a weight sync: rank 1's parameter gets rank 0's bits
        res["old_stamp_same"] = OLD_STAMP(p) == old
        try:
            hal.linear(x, ew, spec=S4)
            res["refused"] = False
        except hal.InputError:
            res["refused"] = True
        m = tiny_model("llama", seed=rank)  # other weights on each rank
        ids = _hf_ids()
        with lt.patch(m, matmul_spec=S4) as patch:
            with torch.no_grad():
                m(input_ids=ids, use_cache=False)
                for q in m.parameters():
                    dist.broadcast(q.data, src=0)
                res["logits"] = m(input_ids=ids, use_cache=False).logits
            res["slicings"] = patch.matmul.slicings
        if rank == 1:
            torch.save(res, out_path)
    finally:
        dist.destroy_process_group()


def test_distributed_broadcast_into_the_parameter(tmp_path):
    import torch.multiprocessing as mp

    from hal.integrations import transformers as lt
    from hal.integrations.transformers.testing import tiny_model
    pytest.importorskip("transformers")
    lt.register()
    out = str(tmp_path / "rank1.pt")
    ctx = mp.start_processes(_broadcast_worker, args=(2, _free_port(), out), nprocs=2, join=False,
                             start_method="spawn")
    t0 = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - t0 > 480:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail("the 2 gloo workers did not finish within 480 s")
    res = torch.load(out)
    assert res["refused"]
    assert res["old_stamp_same"]  # negative control: c10d writes bump no version counter
    ids = _hf_ids()
    m0 = tiny_model("llama", seed=0)  # rank 0's weights, freshly patched here
    with lt.patch(m0, matmul_spec=S4), torch.no_grad():
        want = m0(input_ids=ids, use_cache=False).logits
    assert res["slicings"] == 2 * sum(isinstance(mod, torch.nn.Linear) for mod in m0.modules())
    assert torch.equal(want.view(torch.int32), res["logits"].view(torch.int32))


# ---------------------------------------------------------------- the HF exact patch: re-slices after every write


def _hf_case(write):
    """A patched tiny llama's logits before and after ``write(model)`` (inside the patch), the slicings, and
    the logits of a fresh model holding the written weights under a fresh patch."""
    pytest.importorskip("transformers")
    from test_hf_exact import _fresh_logits, ids, logits, tiny_model

    from hal.integrations import transformers as lt
    x, m = ids(), tiny_model("llama")
    with lt.patch(m, matmul_spec=S4) as patch:
        stale = logits(m, x)
        write(m, x)
        got = logits(m, x)
        slicings = patch.matmul.slicings
    return stale, got, slicings, _fresh_logits(m, x)


def _same(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _hf_loss(m, x):
    return m(input_ids=x, use_cache=False).logits.float().square().mean()


@pytest.mark.parametrize("opt_name, form, kw", OPTIMIZERS, ids=[f"{n}-{f}" for n, f, _ in OPTIMIZERS])
def test_hf_patch_re_slices_after_every_optimizer_form(opt_name, form, kw):
    from test_hf_exact import LLAMA_LINEARS
    params = lambda m: [q for q in m.parameters() if q.dim() == 2]  # noqa: E731  (Muon takes 2-D weights only)
    stale, got, slicings, fresh = _hf_case(lambda m, x: _step(opt_name, kw, params(m), lambda: _hf_loss(m, x)))
    assert slicings == 2 * LLAMA_LINEARS
    assert _same(fresh, got), f"{opt_name} {form}: the patched model's logits are not a fresh patch's"
    assert not _same(stale, got)


def _hf_write(how):
    def write(m, x):
        from test_hf_exact import tiny_model
        donor = tiny_model("llama", seed=1)
        if how == "load_state_dict":
            m.load_state_dict(donor.state_dict())
            return
        for q, d in zip(m.parameters(), donor.parameters()):
            WRITES[how](q, d.detach())
    return write


@pytest.mark.parametrize("how", ["copy_no_grad", "data_copy_", "load_state_dict", "data_rebind_twice"])
def test_hf_patch_re_slices_after_every_write(how):
    from test_hf_exact import LLAMA_LINEARS
    stale, got, slicings, fresh = _hf_case(_hf_write(how))
    assert slicings == 2 * LLAMA_LINEARS
    assert _same(fresh, got) and not _same(stale, got)


def test_hf_negative_control_old_stamp_misses_fused_step(monkeypatch):
    """The patch keyed on the old ``(_version, data_ptr)`` stamp keeps the slices across a fused AdamW step
    (what trainers run by default): its logits are not a fresh patch's."""
    from hal.integrations.transformers import matmul as hf_matmul

    def old_weight(self, w, key):
        hit = self._prepared.get(key)
        if hit is None or hit[0] != OLD_STAMP(w):
            hit = (OLD_STAMP(w), hal.exact_weight(w, spec=self.spec))
            self._prepared[key] = hit
            self.slicings += 1
        return ExactWeight(w, hit[1].spec, hit[1].layout, hit[1].sliced)  # stamped now: the guard sees no change
    monkeypatch.setattr(hf_matmul.PatchMatmul, "weight", old_weight)
    from test_hf_exact import LLAMA_LINEARS
    stale, got, slicings, fresh = _hf_case(lambda m, x: _step("AdamW", {"fused": True}, list(m.parameters()),
                                                              lambda: _hf_loss(m, x)))
    assert slicings == LLAMA_LINEARS  # the old stamp saw no weight change: nothing re-sliced
    assert not _same(fresh, got)


def test_hf_generate_with_inference_mode_weights(monkeypatch):
    """A sampler's model: weights loaded under inference_mode, generate under the exact patch; the same tokens
    and logits as per-call slicing (the oracle), and a weight sync into the inference tensors is seen."""
    pytest.importorskip("transformers")
    from test_hf_exact import LLAMA_LINEARS, ids, per_call, tiny_model

    from hal.integrations import transformers as lt
    x = ids()
    with torch.inference_mode():
        m = tiny_model("llama")
        assert all(q.is_inference() for q in m.parameters())
        runs = []
        for oracle in (False, True):
            with monkeypatch.context() as mp:
                if oracle:
                    per_call(mp)
                with lt.patch(m, matmul_spec=S4):
                    out = m.generate(x, max_new_tokens=4, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
            runs.append((out.sequences, torch.stack(out.logits)))
        assert torch.equal(runs[0][0], runs[1][0]) and _same(runs[0][1], runs[1][1])
        donor = tiny_model("llama", seed=1)
        with lt.patch(m, matmul_spec=S4) as patch:
            before = m(input_ids=x, use_cache=False).logits
            for q, d in zip(m.parameters(), donor.parameters()):
                q.copy_(d)  # an in-place sync into inference tensors: no version counter to bump
            after = m(input_ids=x, use_cache=False).logits
            assert patch.matmul.slicings == 2 * LLAMA_LINEARS
        with lt.patch(donor, matmul_spec=S4):
            want = donor(input_ids=x, use_cache=False).logits
    assert _same(want, after) and not _same(before, after)
