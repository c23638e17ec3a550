"""The weight-change detector (hal/weight_watch.py): the keyed hash of any tensor, and every way weights change.

* the hash: numba == the torch definition under this process's key, for 2-D weights and 1-D norm weights,
  n-D, 1-byte and bool tensors; one flipped bit of a 1-D tensor is seen;
* the key: drawn per process (two processes hash the same tensor differently), never the old public seeds; an
  ExactWeight pickled here and used in another process is refused by name;
* a crafted change (10 values moved by a few ulp, found by lattice reduction against the coefficients) keeps
  the hash under the old fixed, public coefficients -- the control: a prepared weight then serves stale
  outputs -- and is caught under the process key;
* ``ModelWeights`` sees every update kind (fused, foreach and loop AdamW and SGD, ``p.data.copy_``,
  ``p.data =``, ``load_state_dict`` plain and ``assign=True``, writes through ``state_dict()``) on a model
  with 2-D and 1-D weights; the old ``(data_ptr, _version)`` check, computed alongside, misses exactly the
  fused steps and ``.data.copy_`` (negative control). A broadcast: tests/test_hf_engine_weights.py.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

import hal
from hal import weight_watch as ww
from hal.spec import ExactMatmulSpec

S4 = ExactMatmulSpec(slices=4)
OLD_SEEDS = (0x5EED_A, 0x5EED_B)  # the coefficients' seeds before the per-process key: public


def old_check(model) -> tuple:
    """The engine's check before the detector (hf_engine._weights_version): blind to uncounted writes."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


# ---------------------------------------------------------------- every update kind


def _grads(model, seed=7):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)


def _optimizer(name, form):
    def step(model, donor):
        _grads(model)
        kw = {"fused": True} if form == "fused" else {"foreach": form == "foreach"}
        getattr(torch.optim, name)(model.parameters(), lr=0.05, **kw).step()
        model.zero_grad(set_to_none=True)
    return step


def _each(write):
    def update(model, donor):
        with torch.no_grad():
            for p, d in zip(model.parameters(), donor.parameters()):
                write(model, p, d.detach())
    return update


def _state_dict_copy(model, donor):
    with torch.no_grad():
        want = donor.state_dict()
        for k, v in model.state_dict().items():  # the model's own state tensors (detached views of its parameters)
            v.copy_(want[k])


def _data_assign(model, p, d):
    p.data = d.clone()


UPDATES = {
    **{f"{n}-{f}": _optimizer(n, f) for n in ("AdamW", "SGD") for f in ("fused", "foreach", "loop")},
    "data_copy_": _each(lambda m, p, d: p.data.copy_(d)),
    "data_assign": _each(_data_assign),
    "load_state_dict": lambda m, donor: m.load_state_dict(donor.state_dict()),
    "load_state_dict_assign": lambda m, donor: m.load_state_dict(
        {k: v.clone() for k, v in donor.state_dict().items()}, assign=True),
    "state_dict_copy_": _state_dict_copy,
}
OLD_CHECK_BLIND = {"AdamW-fused", "SGD-fused", "data_copy_"}  # plus a broadcast into p.data (engine test)


def _module(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4, bias=False))


@pytest.mark.parametrize("kind", sorted(UPDATES))
def test_model_weights_see_every_update_kind(kind):
    m, donor = _module(0), _module(1)
    watch = ww.ModelWeights(m)
    seen, old = watch.stamp(), old_check(m)
    assert not watch.changed(seen)
    UPDATES[kind](m, donor)
    assert watch.changed(seen), kind
    assert (old_check(m) == old) == (kind in OLD_CHECK_BLIND), "negative control: the old check's blind spots"


# the writes the cheap check (quick stamps + the optimizer step count) cannot see: the engine catches them at
# its next admission (a full check), not at the next step -- the split the docs state
CHEAP_CHECK_BLIND = {"data_copy_"}  # and a broadcast into p.data (engine test)


@pytest.mark.parametrize("kind", sorted(UPDATES))
def test_cheap_check_sees_every_optimizer_step_and_load(kind):
    """Every optimizer kind (fused ones bump no version counter) and every load is seen without reading the
    data; exactly the documented raw writes are not (and the full check sees those)."""
    m, donor = _module(0), _module(1)
    watch = ww.ModelWeights(m)
    seen = watch.stamp()
    assert not watch.quick_changed(seen)
    UPDATES[kind](m, donor)
    assert watch.quick_changed(seen) == (kind not in CHEAP_CHECK_BLIND), kind
    assert watch.changed(seen), kind


def test_optimizer_steps_count_every_optimizer():
    m = _module(0)
    before = ww.optimizer_steps()
    for opt in (torch.optim.AdamW(m.parameters(), fused=True), torch.optim.SGD(m.parameters(), lr=0.1, foreach=True)):
        m(torch.ones(2, 8)).sum().backward()
        opt.step()
    assert ww.optimizer_steps() == before + 2


def test_model_weights_one_norm_weight_and_same_bits():
    """A 1-D norm weight moved by one ulp is a change; a rebind to a copy of the same bits is not (the cheap
    check says "maybe"); a mapping and a callable name the same tensors."""
    m = _module(0)
    watch = ww.ModelWeights(m)
    seen = watch.stamp()
    norm = m[1].weight
    norm.data = norm.data.clone()
    assert watch.quick_changed(seen) and not watch.changed(seen)
    norm.data.view(torch.int32)[3] += 1
    assert watch.changed(seen)
    assert watch.stamp().changed_names(seen) == ["1.weight"]
    assert ww.ModelWeights(dict(m.named_parameters())).stamp().same_bits(watch.stamp())
    assert ww.ModelWeights(m.named_parameters).stamp().same_bits(watch.stamp())
    with pytest.raises(hal.InputError, match="ModelWeights takes"):
        ww.ModelWeights(3)


# ---------------------------------------------------------------- the hash


@pytest.mark.parametrize("t", [
    torch.randn(37, 70, generator=torch.Generator().manual_seed(1)),
    torch.randn(37, 70, generator=torch.Generator().manual_seed(2)).bfloat16().T,
    torch.randn(1100, 1000, generator=torch.Generator().manual_seed(3)).half(),  # numba's threaded kernel
    torch.randn(70, generator=torch.Generator().manual_seed(4)),  # a norm weight
    torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(5)).bfloat16(),
    torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(6)).double()[:, 1:, ::2],
    torch.tensor(2.5),
    torch.randint(-100, 100, (9, 13), dtype=torch.int8, generator=torch.Generator().manual_seed(7)),
    torch.rand(11, generator=torch.Generator().manual_seed(8)) > 0.5,
], ids=["f32", "bf16.T", "f16-big", "1-D", "3-D", "f64-strided", "0-D", "int8", "bool"])
def test_hash_definitions_agree_under_the_process_key(t):
    lane = ww.lanes(t)
    assert lane.dim() == 2 and lane.numel() * lane.element_size() == t.numel() * t.element_size()
    assert ww.content_hash(t) == ww.hash_torch(lane)
    flipped = t.clone().contiguous()
    flipped.view(-1).view(torch.uint8)[-1] ^= 1  # one bit of the last element (its low byte on little-endian)
    assert ww.content_hash(flipped) != ww.content_hash(t)


def test_the_key_is_drawn_per_process_and_stamps_stay_in_theirs(tmp_path):
    """Two processes hash the same tensor differently (and neither with the old public seeds); an ExactWeight
    pickled here is refused by name in another process; a stamp of another key is refused in this one."""
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    assert (ww.process_key().seed_a, ww.process_key().seed_b) != OLD_SEEDS
    w = torch.randn(9, 70, generator=torch.Generator().manual_seed(1))
    (tmp_path / "ew.pkl").write_bytes(pickle.dumps(hal.exact_weight(w, spec=S4)))
    script = f"""
import pickle, torch, hal
from hal import weight_watch as ww
print(ww.content_hash(torch.arange(64, dtype=torch.float32).reshape(8, 8)))
ew = pickle.loads(open({str(tmp_path / "ew.pkl")!r}, "rb").read())
try:
    hal.linear(torch.ones(2, 70), ew, spec=ew.spec)
    print("used")
except hal.InputError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    other_hash, verdict = out.stdout.strip().splitlines()
    assert int(other_hash) != ww.content_hash(t)
    assert verdict.startswith("refused: weight: this weight stamp was taken in another process")
    foreign = ww.TensorStamp.of(t)
    foreign = ww.TensorStamp(foreign.quick, foreign.shape, foreign.dtype, foreign.digest, foreign.key_id ^ 1)
    with pytest.raises(hal.InputError, match="another process"):
        foreign.same_bits(t)


# ---------------------------------------------------------------- a crafted collision


def _lll(basis, delta=Fraction(99, 100)):
    """Lattice reduction (LLL, exact rationals): a basis of short vectors."""
    b = [list(v) for v in basis]
    n = len(b)
    dot = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731
    mu = [[Fraction(0)] * n for _ in range(n)]
    star, norm = [], []
    for i in range(n):
        v = [Fraction(x) for x in b[i]]
        for j in range(i):
            mu[i][j] = dot(b[i], star[j]) / norm[j]
            v = [x - mu[i][j] * y for x, y in zip(v, star[j])]
        star.append(v)
        norm.append(dot(v, v))

    def reduce(k, j):
        q = round(mu[k][j])
        if q:
            b[k] = [x - q * y for x, y in zip(b[k], b[j])]
            mu[k][j] -= q
            for i in range(j):
                mu[k][i] -= q * mu[j][i]
    k = 1
    while k < n:
        reduce(k, k - 1)
        if norm[k] < (delta - mu[k][k - 1] ** 2) * norm[k - 1]:
            m = mu[k][k - 1]
            new = norm[k] + m * m * norm[k - 1]
            mu[k][k - 1] = m * norm[k - 1] / new
            norm[k], norm[k - 1] = norm[k - 1] * norm[k] / new, new
            b[k], b[k - 1] = b[k - 1], b[k]
            for j in range(k - 1):
                mu[k][j], mu[k - 1][j] = mu[k - 1][j], mu[k][j]
            for i in range(k + 1, n):
                t = mu[i][k]
                mu[i][k] = mu[i][k - 1] - m * t
                mu[i][k - 1] = t + mu[k][k - 1] * mu[i][k]
            k = max(k - 1, 1)
        else:
            for j in range(k - 2, -1, -1):
                reduce(k, j)
            k += 1
    return b


def crafted_change(a: list[int]) -> list[int]:
    """Small lane differences D with sum(a[i] * D[i]) = 0 modulo 2**64: a short lattice vector."""
    n, big = len(a), 2 ** 20
    basis = [[int(i == r) for i in range(n)] + [big * (c % 2 ** 64)] for r, c in enumerate(a)]
    basis.append([0] * n + [big * 2 ** 64])
    for v in _lll(basis):
        if v[-1] == 0 and any(v[:-1]):
            return v[:-1]
    raise AssertionError("no short vector")


def test_crafted_change_keeps_the_public_hash_and_is_caught_under_the_process_key(monkeypatch):
    w = (torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) + 1).bfloat16()  # positive: lane +1 = +1 ulp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    row, cols = 5, list(range(3, 53, 5))
    public = ww.ProcessKey(*OLD_SEEDS, ww.process_key().id)
    a = ww._coefficients(64, public.seed_a, torch.device("cpu"))
    d = crafted_change([int(a[c]) for c in cols])
    assert max(map(abs, d)) <= 100, d
    new = w.clone()
    new.view(torch.int16)[row, cols] += torch.tensor(d, dtype=torch.int16)
    assert not torch.equal(new.view(torch.int16), w.view(torch.int16))

    def stale_outputs():
        p = w.clone()
        ew = hal.exact_weight(p, spec=S4)
        p.data.copy_(new)  # bumps no version counter: only the bits tell
        try:
            got = hal.linear(x, ew, spec=S4)
        except hal.InputError as e:
            assert "weight changed since exact_weight" in str(e)
            return None
        want = hal.linear(x, new, spec=S4)
        return int((got.view(torch.int16) != want.view(torch.int16)).any(-1).sum())

    with monkeypatch.context() as mp:  # control: the old, public coefficients
        mp.setattr(ww, "_key", public)
        assert ww.content_hash(new) == ww.content_hash(w)
        assert stale_outputs() > 0  # a prepared weight serves stale rows, with no error
    assert ww.content_hash(new) != ww.content_hash(w)
    assert stale_outputs() is None  # the process key: refused


def test_empty_tensors_hash_to_zero_and_keep_their_shape():
    empty = ww.TensorStamp.of(torch.zeros(2, 0))
    assert empty.digest == 0 and empty.same_bits(torch.zeros(2, 0))
    assert not empty.same_bits(torch.zeros(0, 2))  # the shape is part of the stamp
