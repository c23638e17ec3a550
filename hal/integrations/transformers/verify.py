"""verify(): is a (patched) HF model batch-, padding-, packing- and decode-invariant? audit(): what is left.

Every comparison is on raw bits (hal.conformance.bits.first_divergence). When a check fails, the
two runs are repeated under forward hooks that record every module's output, and the first module
(in execution order) whose output bits differ for the same tokens is reported with its op, the
element index and the ulp distance.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from ...errors import InputError


def cache_kwargs(model, cache) -> dict:
    """The keyword that hands ``cache`` to ``model``'s forward: ``cache`` (transformers 5.24) or
    ``past_key_values`` (5.19, which passes an unknown ``cache=`` on to the layers but builds the mask
    without it)."""
    import inspect
    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _bits():
    from hal.conformance.bits import first_divergence
    return first_divergence


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    first_module: dict | None = None

    def __str__(self):
        s = f"  [{'ok' if self.ok else 'DIFFERS'}] {self.name}"
        if self.detail:
            s += f": {self.detail}"
        if self.first_module:
            m = self.first_module
            s += (f"\n      first divergent module: {m['module']} ({m['op']}), call {m['call']}, "
                  f"element {m['index']}, {m['ulp']} ulp")
        return s


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def __getitem__(self, name) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def __str__(self):
        head = "verify: all checks bit-identical" if self.ok else "verify: some checks differ"
        return "\n".join([head] + [str(c) for c in self.checks])


# ---------------------------------------------------------------- recording module outputs


class _Recorder:
    """Forward hooks on every module recording (name, call index, op, first tensor output)."""

    def __init__(self, model):
        self.model, self.calls, self._hooks, self._count = model, [], [], {}

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if name:
                self._hooks.append(mod.register_forward_hook(self._hook(name, mod)))
        return self

    def _hook(self, name, mod):
        def hook(_m, _args, out):
            t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
            if isinstance(t, torch.Tensor):
                i = self._count.get(name, 0)
                self._count[name] = i + 1
                fwd = mod.__dict__.get("forward")
                op = type(mod).__name__ + (f" [lockstep {fwd.__lockstep__}]" if hasattr(fwd, "__lockstep__")
                                           else " [stock]")
                self.calls.append((name, i, op, t.detach().clone()))
        return hook

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return False


def _rows(t: torch.Tensor, B: int, T: int, rows):
    """The token rows ``rows`` [(b, t)] of a module output shaped [B, T, ...] or [B*T, ...]; else None."""
    if t.dim() >= 2 and tuple(t.shape[:2]) == (B, T):
        return torch.stack([t[b, i] for b, i in rows])
    if t.dim() >= 1 and t.shape[0] == B * T and T > 1:
        return torch.stack([t[b * T + i] for b, i in rows])
    return None


def localise(model, run_a, shape_a, rows_a, run_b, shape_b, rows_b) -> dict | None:
    """Run both closures under recorders; the first module whose outputs for the same tokens differ."""
    first_divergence = _bits()
    with torch.no_grad():
        with _Recorder(model) as ra:
            run_a()
        with _Recorder(model) as rb:
            run_b()
    got = {(n, i): t for n, i, _, t in rb.calls}
    for name, i, op, ta in ra.calls:
        tb = got.get((name, i))
        if tb is None:
            continue
        xa, xb = _rows(ta, *shape_a, rows_a), _rows(tb, *shape_b, rows_b)
        if xa is None or xb is None or xa.shape != xb.shape:
            continue
        d = first_divergence(name, xa, xb)
        if d is not None:
            return dict(module=name, op=op, call=i, index=d.index, ulp=d.ulp, expected=d.expected, got=d.got)
    return None


# ---------------------------------------------------------------- verify


def _sequences(vocab_size, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


def _forward(model, ids, mask=None, pos=None, **kw):
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **kw).logits.float()


def _check_vocab_size(model, vocab_size) -> int:
    """verify draws token ids in [0, vocab_size): refuse what the model's input embedding cannot take."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    try:  # an int or an integer scalar (numpy, 0-d tensor); not a bool, float or string
        n = None if isinstance(vocab_size, bool) else operator.index(vocab_size)
    except TypeError:
        n = None
    if n is None or n < 1 or (rows is not None and n > rows):
        limit = f"[1, {rows}] (the rows of the model's input embedding)" if rows is not None else ">= 1"
        raise InputError(f"vocab_size: verify draws token ids in [0, vocab_size), so it must be an int in {limit}, "
                         f"got {vocab_size!r}")
    return n


def verify(model, vocab_size: int, lengths=(9, 5, 13), *, seed: int = 0, decode_steps: int = 3,
           localise_failures: bool = True) -> Report:
    """Compare, on raw bits of the logits (no grad):

    * each sequence alone vs the same sequence in a right-padded batch, a left-padded batch, and a
      packed row (position_ids restart at 0; no attention mask);
    * teacher-forced full forward vs incremental decode: a left-padded batch of the prefixes is
      prefilled into a DynamicCache, then the last ``decode_steps`` tokens are fed one at a time.

    A failing check names the first module (execution order) whose output bits differ.
    Works on any model (patched or not): on a stock model it shows what differs.
    """
    vocab_size = _check_vocab_size(model, vocab_size)
    if not lengths or any(int(n) < 2 for n in lengths):
        raise InputError(f"lengths must be >= 2 each, got {lengths}")
    if decode_steps < 1 or decode_steps >= min(lengths):
        raise InputError(f"decode_steps must be in [1, min(lengths) - 1], got {decode_steps}")
    first_divergence = _bits()
    seqs = _sequences(vocab_size, lengths, seed)
    n, L = len(seqs), max(lengths)
    rep = Report()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = [_forward(model, s[None])[0] for s in seqs]
        layouts = {}
        # right padding
        ids = torch.zeros(n, L, dtype=torch.long)
        mask = torch.zeros(n, L, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, :len(s)], mask[b, :len(s)] = s, 1
        pos = torch.arange(L).expand(n, L)
        layouts["right-padded batch"] = (ids, mask, pos, [[(b, t) for t in range(len(s))] for b, s in enumerate(seqs)])
        # left padding (positions count from each sequence's first real token)
        ids = torch.zeros(n, L, dtype=torch.long)
        mask = torch.zeros(n, L, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, L - len(s):], mask[b, L - len(s):] = s, 1
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        layouts["left-padded batch"] = (ids, mask, pos, [[(b, L - len(s) + t) for t in range(len(s))]
                                                         for b, s in enumerate(seqs)])
        # packed
        ids = torch.cat(seqs)[None]
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        offs = [sum(lengths[:b]) for b in range(n)]
        layouts["packed row"] = (ids, None, pos, [[(0, offs[b] + t) for t in range(len(s))] for b, s in enumerate(seqs)])

        for name, (ids, mask, pos, rows) in layouts.items():
            with torch.no_grad():
                out = _forward(model, ids, mask, pos)
            bad = None
            for b, s in enumerate(seqs):
                got = torch.stack([out[r] for r in rows[b]])
                d = first_divergence(f"sequence {b} (length {len(s)})", alone[b], got)
                if d is not None:
                    bad = (b, d)
                    break
            chk = Check(f"alone == {name}", bad is None, "" if bad is None else str(bad[1]))
            if bad is not None and localise_failures:
                b = bad[0]
                chk.first_module = localise(
                    model, lambda: _forward(model, seqs[b][None]), (1, len(seqs[b])),
                    [(0, t) for t in range(len(seqs[b]))],
                    lambda: _forward(model, ids, mask, pos), tuple(ids.shape), rows[b])
            rep.checks.append(chk)

        rep.checks.append(_decode_check(model, seqs, alone, decode_steps, localise_failures))
    finally:
        model.train(was_training)
    return rep


class _BatchedDecode:
    """The decode check's run: a left-padded prefill of every sequence's prefix (all but its last ``k``
    tokens) into a DynamicCache, then one token per sequence per :meth:`step`."""

    def __init__(self, model, seqs, k):
        from transformers import DynamicCache
        self.model, self.seqs, n = model, seqs, len(seqs)
        self.pre = [len(s) - k for s in seqs]
        P = max(self.pre)
        ids = torch.zeros(n, P, dtype=torch.long)
        self.mask = torch.zeros(n, P, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, P - self.pre[b]:], self.mask[b, P - self.pre[b]:] = s[:self.pre[b]], 1
        self.cache = DynamicCache(config=model.config)
        pos = (self.mask.cumsum(-1) - 1).clamp_min(0)
        model(input_ids=ids, attention_mask=self.mask, position_ids=pos, use_cache=True, **cache_kwargs(model, self.cache))

    def step(self, step):
        """Logits [n, V] of decode step ``step`` (steps run in order, each once)."""
        n = len(self.seqs)
        tok = torch.stack([s[self.pre[b] + step] for b, s in enumerate(self.seqs)])[:, None]
        self.mask = torch.cat([self.mask, torch.ones(n, 1, dtype=torch.long)], -1)
        pos = torch.tensor([[self.pre[b] + step] for b in range(n)])
        out = self.model(input_ids=tok, attention_mask=self.mask, position_ids=pos, use_cache=True,
                         **cache_kwargs(self.model, self.cache))
        return out.logits.float()[:, -1]


def _decode_check(model, seqs, alone, k, do_localise) -> Check:
    """Left-padded prefill of the prefixes, then ``k`` one-token steps; step logits vs teacher-forced."""
    first_divergence = _bits()
    name = "teacher-forced == incremental decode (left-padded batch, DynamicCache)"
    with torch.no_grad():
        run = _BatchedDecode(model, seqs, k)
        for step in range(k):
            logits = run.step(step)
            for b in range(len(seqs)):
                p = run.pre[b] + step
                d = first_divergence(f"sequence {b}, decode step {step} (position {p})", alone[b][p], logits[b])
                if d is not None:
                    return Check(name, False, str(d), _localise_decode(model, seqs, k, b, step) if do_localise else None)
    return Check(name, True)


def _localise_decode(model, seqs, k, b, step):
    """Sequence b's teacher-forced forward alone vs the failing decode step of the same batched run
    (replayed up to that step), so a batch-dependent divergence is localised as well as a decode one."""
    with torch.no_grad():
        run = _BatchedDecode(model, seqs, k)
        for s in range(step):
            run.step(s)
    p, s = run.pre[b] + step, seqs[b]
    return localise(model, lambda: _forward(model, s[None, :p + 1]), (1, p + 1), [(0, p)],
                    lambda: run.step(step), (len(seqs), 1), [(b, 0)])


# ---------------------------------------------------------------- audit


@dataclass
class Audit:
    stock_modules: list[tuple[str, str]]      # (name, class) of modules that ran with their stock forward
    lockstep_modules: list[tuple[str, str]]   # (name, kind) that ran with a lockstep forward
    aten_ops: dict[str, int]                  # rounding aten ops seen outside lockstep's own kernels, with counts

    def __str__(self):
        lines = [f"audit: {len(self.lockstep_modules)} module calls through lockstep, "
                 f"{len(self.stock_modules)} stock module calls with their own arithmetic"]
        for n, c in self.stock_modules:
            lines.append(f"  stock: {n} ({c})")
        if self.aten_ops:
            lines.append("  rounding aten ops outside hal: " + ", ".join(f"{k} x{v}" for k, v in
                                                                         sorted(self.aten_ops.items())))
        return "\n".join(lines)


# aten ops whose floating-point result can depend on the call's shape or the element's position
# (reductions, matmuls, transcendental functions); exact ones (copies, index ops, one add or
# multiply of two numbers) and integer arithmetic are not counted
_ROUNDING = {"mm", "addmm", "bmm", "matmul", "baddbmm", "dot", "mv", "_softmax", "_log_softmax", "mean", "sum",
             "exp", "log", "log1p", "expm1", "rsqrt", "sqrt", "sigmoid", "silu", "softplus", "tanh", "cos", "sin",
             "pow", "var", "norm", "linalg_vector_norm", "convolution", "cumsum", "cumprod", "logsumexp", "erf",
             "gelu", "linalg_solve_triangular", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_attention_math", "_fused_rms_norm", "native_layer_norm", "topk", "prod"}


def audit(model, input_ids, **forward_kwargs) -> Audit:
    """Run one forward (no grad) and list what computed outside hal.

    Modules: every module that ran with its class's own forward although it holds parameters or is a
    norm/activation/attention (containers and exact modules such as embeddings are left out). Ops:
    aten ops that round, dispatched while no lockstep module forward was on the stack (a
    TorchDispatchMode), so lockstep's own reference kernels are not counted.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from .modules import refresh_stale
    refresh_stale(model)  # modules attached since the patch: patched (or refused) as the forward would
    stack: list[str] = []
    stock, lock, ops = [], [], {}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            base = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
            if base in _ROUNDING and not any(s.startswith("L:") for s in stack):
                floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
                if floats:
                    key = f"aten.{base}"
                    ops[key] = ops.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    hooks = []
    for name, mod in model.named_modules():
        if not name:
            continue
        fwd = mod.__dict__.get("forward")
        is_lock = hasattr(fwd, "__lockstep__")
        own = any(True for _ in mod.parameters(recurse=False))
        cls = type(mod).__name__
        interesting = own or any(w in cls for w in ("Norm", "Activation", "Attention", "Rotary", "MLP", "SiLU"))

        def pre(_m, _a, name=name, is_lock=is_lock, cls=cls, interesting=interesting, fwd=fwd):
            stack.append(("L:" if is_lock else "S:") + name)
            if is_lock:
                lock.append((name, fwd.__lockstep__))
            elif interesting and cls not in ("Embedding",) and not any(s.startswith("L:") for s in stack[:-1]):
                stock.append((name, cls))

        def post(_m, _a, _o):
            stack.pop()
        hooks.append(mod.register_forward_pre_hook(pre))
        hooks.append(mod.register_forward_hook(post))
    try:
        with torch.no_grad(), Mode():
            model(input_ids=input_ids, use_cache=False, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    return Audit(stock, lock, ops)
