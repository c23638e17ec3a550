"""Op specs: frozen, hashable descriptions of a canonical computation.

A spec fixes everything that decides the bits of an op's output: the precision policy, the tile
size along every reduction axis, the order partial results are combined in, the accumulation and
output dtypes, and where rounding happens. Two calls with equal specs and equal inputs must give
equal bits on every backend that supports the spec (the L4 promise of the `strict` policy).

Every spec has a stable, human-readable id derived from its fields, e.g. ``matmul.strict.k64.v2``.
Whatever changes the bits changes the id; golden files and reports carry the id.

The arithmetic shared by every strict spec (see ``kernels/reference/strict_math.py``):

* inputs of any float dtype are widened exactly to float32;
* every product that feeds a sum is one fused multiply-add, rounded once (``fma(a, b, c)``) --
  so no compiler can change the bits by contracting ``a*b + c`` (XLA does under ``jax.jit``);
* a reduction along an axis of length n with tile T is: tiles of T consecutive elements anchored
  at index 0; inside a tile a sequential chain from +0.0 in increasing index; the tile partials
  added sequentially from +0.0 in increasing tile index; elements past the end are skipped
  (the accumulator is kept as it is, an exact identity even for -0.0 and NaN);
* ``exp`` and ``log`` are lockstep's own (``lsm1``: range reduction + polynomial written with fma,
  division and square root only); division and square root are correctly rounded IEEE operations;
* results are rounded once, to the output dtype, round-to-nearest-even; no flush to zero;
* every NaN result is the canonical quiet NaN of its dtype (float32 0x7FC00000, bfloat16 0x7FC0,
  float16 0x7E00): NaN payloads differ between vendors and even between torch's vector and scalar
  paths, so a spec that let them through could not give the same bits everywhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from .errors import SpecError

STRICT = "strict"
FAST = "fast"
#: Integer-exact accumulation (matmul family only): any order, split or tiling gives the same bits.
EXACT = "exact"
POLICIES = (STRICT, FAST, EXACT)

#: Version tag of lockstep's own exp/log/sin/cos (kernels/reference/strict_math.py). Part of every id of a
#: spec that uses them: a new polynomial means new bits and so a new id.
MATH_VERSION = "lsm1"


@dataclass(frozen=True)
class OpSpec:
    """Base of all specs. Subclasses add the fields that decide their bits."""

    family: ClassVar[str] = ""
    #: Policies this spec class can describe (exact needs its own fields: ExactMatmulSpec).
    policies: ClassVar[tuple[str, ...]] = (STRICT, FAST)
    policy: str = STRICT
    #: 2: the canonical NaN became part of the strict policy (every v1 spec's bits could differ on NaN).
    version: int = 2

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise SpecError(f"{type(self).__name__}: policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy not in self.policies:
            hint = {EXACT: " (use ExactMatmulSpec(slices=...))",
                    FAST: {"matmul": " (use FastMatmulSpec(...))",
                           "attention": " (use FastAttentionSpec(...))"}.get(self.family, "")}.get(self.policy, "")
            raise SpecError(f"{type(self).__name__}: policy {self.policy!r} not available for this spec; "
                            f"one of {self.policies}{hint}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("tile") and (not isinstance(v, int) or v <= 0):
                raise SpecError(f"{type(self).__name__}.{f.name} must be a positive int, got {v!r}")
        self._validate()

    def _validate(self) -> None:  # subclasses check their own invariants
        pass

    def _id_parts(self) -> list[str]:
        raise NotImplementedError

    @classmethod
    def _fields_from_id(cls, parts: list[str]) -> dict:
        """The inverse of :meth:`_id_parts`: the fields (besides policy and version) an id's middle names.
        Raises ValueError when ``parts`` is not of this class's form (:func:`from_id` checks the round trip)."""
        raise ValueError(f"{cls.__name__} ids are not parsed")

    def policies_used(self) -> frozenset[str]:
        """Every policy this spec's computation needs (a backend must implement all of them)."""
        return frozenset((self.policy,))

    @property
    def id(self) -> str:
        return ".".join([self.family, self.policy, *self._id_parts(), f"v{self.version}"])

    def describe(self) -> list[str]:
        """The computation in words, one line per decision."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.id


def tile(default: int):
    return field(default=default, metadata={"tile": True})


def _tiles(parts: list[str], **prefixes: str) -> dict:
    """``["k32"]``, k_tile="k" -> {"k_tile": 32}: one part per field, in order, each its prefix and an int."""
    if len(parts) != len(prefixes):
        raise ValueError(f"{len(parts)} parts for {len(prefixes)} fields")
    fields = {}
    for part, (name, prefix) in zip(parts, prefixes.items()):
        digits = part[len(prefix):]
        if not part.startswith(prefix) or not digits.isdigit():
            raise ValueError(f"{part!r} is not {prefix}<int>")
        fields[name] = int(digits)
    return fields


def _check_dot_tiles(spec, *names: str):
    """A fast spec's tile sizes feed ``tl.dot`` (powers of two >= 16) and its warp count a launch (a power of two)."""
    kind = type(spec).__name__
    for name in names:
        v = getattr(spec, name)
        if v < 16 or v & (v - 1):
            raise SpecError(f"{kind}.{name} must be a power of two >= 16 (tl.dot's smallest tile), got {v}")
    if spec.num_warps & (spec.num_warps - 1):
        raise SpecError(f"{kind}.num_warps must be a power of two, got {spec.num_warps}")


def _math(parts: list[str]) -> list[str]:
    """The parts before the trailing math version, which must be this library's (other math: other bits)."""
    if not parts or parts[-1] != MATH_VERSION:
        raise ValueError(f"no {MATH_VERSION} part")
    return parts[:-1]


def _reduction_words(axis: str, t: int) -> str:
    return (f"reduction over {axis}: tiles of {t} anchored at index 0; a sequential fma chain from +0.0 "
            f"inside each tile; tile partials added in increasing tile order from +0.0")


def _policy_words(policy: str) -> str:
    if policy == STRICT:
        return ("policy strict: IEEE float32 fma, +, -, /, sqrt only, each rounded to nearest even; "
                f"lockstep's own exp/log ({MATH_VERSION}); no flush-to-zero; every NaN output is the canonical quiet NaN "
                "of its dtype (float32 0x7FC00000, bfloat16 0x7FC0, float16 0x7E00), whatever NaN produced it; "
                "same bits on every backend (L4)")
    return ("policy fast: vendor matrix units and vendor math allowed inside a backend; tiling and "
            "combine order still fixed (L0-L3 within one backend and device type)")


@dataclass(frozen=True)
class MatmulSpec(OpSpec):
    """``out[m, n] = sum_k a[m, k] * b[k, n]`` (+ bias), accumulated in float32."""

    family: ClassVar[str] = "matmul"
    #: fast matmul has its own fields (tile shape, warps, stages): FastMatmulSpec
    policies: ClassVar[tuple[str, ...]] = (STRICT,)
    k_tile: int = tile(64)

    def _id_parts(self):
        return [f"k{self.k_tile}"]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(parts, k_tile="k")

    def describe(self):
        return [
            _policy_words(self.policy),
            "inputs widened exactly to float32",
            _reduction_words("K", self.k_tile),
            "linear: bias (float32) added once after the K reduction",
            "output rounded once to the input dtype",
        ]


@dataclass(frozen=True)
class FastMatmulSpec(OpSpec):
    """matmul / linear on tensor cores (``tl.dot``, float32 accumulation) with the tiling fixed here.

    Bits hold across calls, batch sizes and processes on one GPU model with one Triton version
    (L0-L3); across GPU models or vendors nothing is promised (no L4, no goldens). Every knob that
    can change the bits is a field and part of the id, so no heuristic (batch size, autotuner) can
    choose it. docs/fast_policy.md.
    """

    family: ClassVar[str] = "matmul"
    policies: ClassVar[tuple[str, ...]] = (FAST,)
    policy: str = FAST
    version: int = 2
    # defaults sized for H100/H200 (bf16 wgmma): a 128x128 output tile, K in steps of 64
    block_m: int = tile(128)
    block_n: int = tile(128)
    block_k: int = tile(64)
    num_warps: int = tile(8)
    num_stages: int = tile(3)

    def _validate(self):
        _check_dot_tiles(self, "block_m", "block_n", "block_k")

    def _id_parts(self):
        return [f"m{self.block_m}", f"n{self.block_n}", f"k{self.block_k}", f"w{self.num_warps}",
                f"s{self.num_stages}"]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(parts, block_m="m", block_n="n", block_k="k", num_warps="w", num_stages="s")

    def describe(self):
        bm, bn, bk = self.block_m, self.block_n, self.block_k
        return [
            "policy fast: the GPU's matrix unit does the products and the sums inside an instruction; what "
            "decides the bits outside it is fixed here. Same GPU model + same Triton version + same spec => "
            "same bits (L0-L3); across GPU models, vendors or Triton versions nothing is promised (no L4)",
            "dtypes: bfloat16 and float16 only (float32 is refused, not silently run as tf32)",
            f"output tile {bm} x {bn} per program, {self.num_warps} warps, {self.num_stages} pipeline stages; "
            "every output row depends only on its own row of A (rows are independent: batch invariance)",
            f"K reduction: K padded with zeros to a multiple of {bk}; one accumulator from +0.0, "
            f"acc = tl.dot(a_tile, b_tile, acc) over K tiles of {bk} in increasing order (one chain, no split-K); "
            "inside a tile the hardware decides (wgmma / mma, float32 accumulation)",
            "linear: bias widened to float32 and added once after the K reduction (one float32 addition)",
            "output rounded once to the input dtype, round-to-nearest-even by integer operations (no flush to "
            "zero); every NaN output is the canonical NaN of its dtype (bfloat16 0x7FC0, float16 0x7E00)",
        ]


#: FastMatmulV3Spec's table of launches (issue 49), by the number of rows M: (largest M, block_m, block_n, block_k,
#: num_warps, num_stages, persistent grid, TMA loads). Every entry is a wgmma launch on sm_90 (block_m >= 64, warps
#: a multiple of 4: fast_lint checks it in Triton 3.6's code) and is raw-bit-checked against the reference launch
#: (the v2 default's 128 x 128 x 64, 8 warps, 3 stages) by benchmarks/fast_bits_sweep.py on the device.
FAST_MATMUL_V3_TABLE = (
    (64, 64, 32, 256, 4, 3, False, False),      # decode, 1-64 rows: N / 32 programs (128 at N 4096), deep K steps
    (256, 64, 64, 128, 4, 4, False, False),     # batched decode, 65-256 rows
    (None, 128, 256, 64, 8, 3, True, True),     # prefill: one program per SM over 128 x 256 tiles, TMA loads
)
#: The prefill entry with pointer loads: what it runs where TMA cannot describe an operand (a row not 16-byte
#: aligned, e.g. N = 17 columns of bf16), so that no batch and no shape is refused for want of TMA.
FAST_MATMUL_V3_NO_TMA = (None, 128, 256, 64, 8, 3, True, False)
FAST_MATMUL_V3_TABLE_ID = "t1"  # a new table (other launches) is a new id


@dataclass(frozen=True)
class FastMatmulV3Spec(OpSpec):
    """matmul / linear on tensor cores with the launch chosen by shape from a table of verified launches.

    What v3 fixes: one instruction family (``wgmma`` on sm_90); the K reduction as one float32 accumulator from
    +0.0 advanced in K steps of 16 (the bf16 / fp16 ``wgmma`` instruction's k16) in increasing order, K past its end
    zero; no split-K; the epilogue of v2. What v3 frees: the tile (block_m / block_n / block_k), warps, stages,
    persistent grid and TMA loads, among the table's launches (FAST_MATMUL_V3_TABLE; any other launch is refused).
    **That freedom is a hypothesis** (each output element is one k16 chain of instructions whatever the tile) that
    no GPU has checked yet: benchmarks/fast_bits_sweep.py answers it on the device. Until it has, v2 stays the
    default and v3 is opt-in. docs/fast_policy.md.
    """

    family: ClassVar[str] = "matmul"
    policies: ClassVar[tuple[str, ...]] = (FAST,)
    policy: str = FAST
    version: int = 3
    instruction: str = "wgmma"
    k_step: int = 16
    table: str = FAST_MATMUL_V3_TABLE_ID

    def _validate(self):
        if self.version != 3:
            raise SpecError(f"FastMatmulV3Spec.version is 3, got {self.version!r} (v2: FastMatmulSpec)")
        if (self.instruction, self.k_step, self.table) != ("wgmma", 16, FAST_MATMUL_V3_TABLE_ID):
            raise SpecError(f"FastMatmulV3Spec: only instruction 'wgmma', k_step 16, table "
                            f"{FAST_MATMUL_V3_TABLE_ID!r} exist, got {self.instruction!r}, {self.k_step!r}, "
                            f"{self.table!r}")

    def _id_parts(self):
        return [self.instruction, f"k{self.k_step}", self.table]

    @classmethod
    def _fields_from_id(cls, parts):
        if len(parts) != 3 or not parts[1].startswith("k") or not parts[1][1:].isdigit():
            raise ValueError(f"{parts!r} is not instruction.k<int>.table")
        return {"instruction": parts[0], "k_step": int(parts[1][1:]), "table": parts[2]}

    def launch_entry(self, m: int) -> tuple:
        """The table's (block_m, block_n, block_k, num_warps, num_stages, persistent, tma) for M rows."""
        for top, *entry in FAST_MATMUL_V3_TABLE:
            if top is None or m <= top:
                return tuple(entry)
        raise AssertionError("the table's last entry takes every M")

    def describe(self):
        rows = "; ".join((f"M <= {top}: " if top else "larger M: ") + f"{bm}x{bn}x{bk} {w} warps {st} stages"
                         + (" persistent" if pers else "") + (" TMA" if tma else "")
                         for top, bm, bn, bk, w, st, pers, tma in FAST_MATMUL_V3_TABLE)
        return [
            "policy fast, v3: the GPU's matrix unit does the products and the sums inside an instruction; what decides "
            "the bits outside it is fixed here. Same GPU model + same Triton version + same spec => same bits "
            "(L0-L3); across GPU models, vendors or Triton versions nothing is promised (no L4)",
            "dtypes: bfloat16 and float16 only (float32 is refused, not silently run as tf32)",
            f"instruction family: {self.instruction} (sm_90); every launch of the table lowers to it",
            f"K reduction: one float32 accumulator from +0.0, advanced by one instruction per {self.k_step} K values in "
            "increasing order (K past its end is zero); no split-K; every output row depends only on its own row of "
            "A (batch invariance)",
            "launch: chosen by the number of rows from the static table " + self.table + " (" + rows + "; the "
            "prefill launch with pointer loads where TMA cannot describe an operand): tile, warps, stages, persistent grid and TMA loads; a launch outside the table is refused",
            "HYPOTHESIS, not yet checked on a GPU: that the tile, warps, stages, grid and loads of the table do not "
            "change an output (benchmarks/fast_bits_sweep.py decides it on the device); until then v2 is the default",
            "linear: bias widened to float32 and added once after the K reduction (one float32 addition)",
            "output rounded once to the input dtype, round-to-nearest-even by integer operations (no flush to "
            "zero); every NaN output is the canonical NaN of its dtype (bfloat16 0x7FC0, float16 0x7E00)",
        ]


EXACT_MAX_SLICES = 4  # the two-limb accumulator of kernels/exact/core.py holds s <= 4


@dataclass(frozen=True)
class ExactMatmulSpec(OpSpec):
    """matmul / linear with integer-exact accumulation of ``slices`` signed 7-bit slices per value.

    The result is the correctly rounded dot product of the sliced inputs, whatever the order of
    the K reduction: any tiling, split-K, thread count or tensor-parallel degree gives the same bits.
    Written out in ``kernels/exact/core.py``; measurements and the choice of s in docs/exact_matmul.md.
    """

    family: ClassVar[str] = "matmul"
    policies: ClassVar[tuple[str, ...]] = (EXACT,)
    policy: str = EXACT
    version: int = 2  # born with the canonical-NaN convention of the v2 strict specs
    slices: int = 3

    def _validate(self):
        if not isinstance(self.slices, int) or not 1 <= self.slices <= EXACT_MAX_SLICES:
            raise SpecError(f"ExactMatmulSpec.slices must be an int in [1, {EXACT_MAX_SLICES}], got {self.slices!r}")

    def _id_parts(self):
        return [f"s{self.slices}"]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(parts, slices="s")

    def describe(self):
        s = self.slices
        top = 2 * (7 * s - 1)
        return [
            "policy exact: the K reduction is an exact integer sum (any order, tiling, split-K, thread count "
            "or tensor-parallel degree gives the same bits); one correct rounding at the end",
            "scales: every row of A (linear: of x) and every output channel of B (matmul: column of b; linear: "
            "row of weight) gets E = max over its K values of floor(log2|v|), over finite non-zero v (E = 0 "
            "when there is none); one power of two per row, over the whole K axis",
            f"slicing: T = trunc(v * 2**({7 * s - 1} - E)) (towards zero, exact), |T| < 2**{7 * s}; T is cut into "
            f"{s} base-128 digits of |T|, most significant first, each with v's sign: "
            f"v' = sum_t V_t * 2**(E - 6 - 7t), V_t in [-127, 127] (int8); NaN and +-inf slice as 0",
            "products: P_tu[m, n] = sum_k A_t[m, k] * B_u[k, n] for all t, u in [0, s) (int8 x int8, summed "
            "exactly: int32 for K <= 131072 per piece, pieces added in int64)",
            f"combine: S = sum_tu P_tu * 2**(7 * ({2 * s - 2} - t - u)), exact (two int64 limbs: S = H * 2**28 + R); "
            f"K <= 2**24",
            f"rounding: S * 2**(Ea[m] + Eb[n] - {top}) rounded once to nearest even in the output dtype "
            "(matmul/linear: the input dtype), with overflow to +-inf and gradual underflow (no flush to zero); "
            "an exact zero is +0.0",
            "non-finite inputs: an output whose row of A or column of B holds NaN or +-inf takes the IEEE value of "
            "sum_k a*b: NaN if any product is NaN (a NaN input, inf * 0) or +inf and -inf products meet, else "
            "that infinity",
            "linear bias: the dot is rounded once to float32 (as above), bias (widened to float32) is added "
            "with one float32 addition, the sum is rounded to the output dtype",
            "every NaN output is the canonical NaN of its dtype (float32 0x7FC00000, bfloat16 0x7FC0, "
            "float16 0x7E00)",
        ]


@dataclass(frozen=True)
class RMSNormSpec(OpSpec):
    """``y = x / sqrt(mean(x^2) + eps) * w``; with a residual, ``h = x + r`` is normalised."""

    family: ClassVar[str] = "rms_norm"
    hidden_tile: int = tile(256)

    def _id_parts(self):
        return [f"h{self.hidden_tile}"]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(parts, hidden_tile="h")

    def describe(self):
        return [
            _policy_words(self.policy),
            "residual (optional): h = x + r added in float32 and rounded to the input dtype; that rounded h "
            "is both the new residual and the value normalised (so fused == unfused)",
            "sum of squares: " + _reduction_words("hidden", self.hidden_tile),
            "ms = ss / H; inv = 1 / sqrt(ms + eps) (division and sqrt correctly rounded)",
            "y = (x * inv) * w in float32, rounded once to the input dtype",
        ]


@dataclass(frozen=True)
class SoftmaxSpec(OpSpec):
    """softmax / log_softmax / logsumexp along one axis, tiled along that axis."""

    family: ClassVar[str] = "softmax"
    tile: int = tile(256)

    def _id_parts(self):
        return [f"t{self.tile}", MATH_VERSION]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(_math(parts), tile="t")

    def describe(self):
        return [
            _policy_words(self.policy),
            "inputs widened exactly to float32",
            f"tiles of {self.tile} along the axis, anchored at index 0; M = max of the row (exact, order-free)",
            "per tile: s_t = sequential sum from +0.0 of exp(x - M) over the tile's elements",
            "S = tile partials s_t added in increasing tile order from +0.0",
            "logsumexp = M + log(S); log_softmax = (x - M) - log(S); softmax = exp(x - M) / S",
            "a row that is all -inf (fully masked): logsumexp -inf, log_softmax -inf, softmax 0; "
            "a NaN or +inf anywhere in a row makes every output of that row NaN",
            "softmax/log_softmax rounded once to the input dtype; logsumexp likewise",
        ]


@dataclass(frozen=True)
class TokenLogprobsSpec(OpSpec):
    """log p(token) from hidden states and an LM head: fp32 logits, vocab-tiled log-softmax.

    ``matmul`` chooses the logits' dot: None (default) is the strict fma chain tiled by
    ``hidden_tile``; an :class:`ExactMatmulSpec` makes it the exact policy's order-free dot, rounded
    once to float32; a :class:`FastMatmulSpec` / :class:`FastMatmulV3Spec` the fast policy's tensor-core
    dot, its float32 accumulator kept as the logit (no output rounding). With a matmul ``hidden_tile`` does
    not apply and must keep its default. The log-softmax is the strict one whatever the dot. The id names
    the dot: ``token_logprobs.strict.exact-s4.v256.lsm1.v2``,
    ``token_logprobs.strict.fast-m128-n128-k64-w8-s3-v2.v256.lsm1.v2`` (the fast matmul's id, dashed).
    """

    family: ClassVar[str] = "token_logprobs"
    hidden_tile: int = tile(64)
    vocab_tile: int = tile(256)
    matmul: "ExactMatmulSpec | FastMatmulSpec | FastMatmulV3Spec | None" = None

    def _validate(self):
        if self.matmul is None:
            return
        if not isinstance(self.matmul, (ExactMatmulSpec, FastMatmulSpec, FastMatmulV3Spec)):
            raise SpecError(f"TokenLogprobsSpec.matmul must be None (the strict chain), an ExactMatmulSpec, a "
                            f"FastMatmulSpec or a FastMatmulV3Spec, got {self.matmul!r}")
        if self.hidden_tile != 64:
            raise SpecError(f"TokenLogprobsSpec: hidden_tile does not apply with the matmul {self.matmul.id} (its dot "
                            "fixes the hidden axis' order, or has none); leave it at its default")

    def policies_used(self):
        return super().policies_used() | (self.matmul.policies_used() if self.matmul else frozenset())

    def _id_parts(self):
        if self.matmul is None:
            dot = f"h{self.hidden_tile}"
        elif self.matmul.policy == EXACT:
            dot = f"exact-s{self.matmul.slices}"
        else:  # the fast matmul's whole id but its family: policy, fields and version, dashed (one id part)
            dot = "-".join(self.matmul.id.split(".")[1:])
        return [dot, f"v{self.vocab_tile}", MATH_VERSION]

    @classmethod
    def _fields_from_id(cls, parts):
        parts = _math(parts)
        if parts and parts[0].startswith("exact-"):
            return dict(matmul=ExactMatmulSpec(**_tiles(parts[:1], slices="exact-s")), **_tiles(parts[1:], vocab_tile="v"))
        if parts and parts[0].startswith(f"{FAST}-"):
            matmul = from_id(".".join(["matmul", *parts[0].split("-")]))
            if matmul is None or matmul.policy != FAST:
                raise ValueError(f"{parts[0]!r} names no fast matmul spec")
            return dict(matmul=matmul, **_tiles(parts[1:], vocab_tile="v"))
        return _tiles(parts, hidden_tile="h", vocab_tile="v")

    def describe(self):
        if self.matmul is None:
            dot = "logits[n, v] = hidden[n] . W[v] in float32: " + _reduction_words("hidden", self.hidden_tile)
        elif self.matmul.policy == EXACT:
            dot = (f"logits[n, v] = hidden[n] . W[v] under {self.matmul.id} (rows of hidden and of W sliced, "
                   "exact integer sum in any order), rounded once to float32: `hal spec show "
                   f"{self.matmul.id}` gives the arithmetic; a NaN/inf input follows its IEEE rule")
        else:
            dot = (f"logits[n, v] = hidden[n] . W[v] under {self.matmul.id}: the fast matmul's tensor-core dot "
                   "(bfloat16 / float16 inputs only, its float32 accumulator and K order; `hal spec show "
                   f"{self.matmul.id}` gives them), kept as float32: no output rounding (a NaN logit is the "
                   "canonical one)")
        fast = self.matmul is not None and self.matmul.policy == FAST
        return [
            ("policies strict (the log-softmax: IEEE float32 fma, +, -, /, sqrt, lockstep's own exp/log "
             f"({MATH_VERSION}), no flush-to-zero, canonical NaN) and fast (the logits' dot): same bits on one GPU "
             "model with one Triton version (L0-L3), nothing across them (no L4)") if fast else
            _policy_words(self.policy),
            dot,
            "temperature: logits / T (correctly rounded division; skipped bit-exactly when T == 1)",
            f"log-softmax over the vocab as the softmax spec with tile {self.vocab_tile}",
            "output: float32 (x_token - M) - log(S), never rounded to a lower precision",
        ]


ATTN_P_PRECISIONS = ("fp32", "input")


@dataclass(frozen=True)
class AttentionSpec(OpSpec):
    """Softmax attention: KV blocks of ``kv_block`` and splits of ``kv_split`` keys anchored at key 0.

    The full computation is written out in ``kernels/reference/attention.py`` and in words by
    :meth:`describe`; ``docs/attention.md`` explains why it makes prefill, chunked prefill,
    decode, paged KV and any ``num_splits`` give the same bits.
    """

    family: ClassVar[str] = "attention"
    #: fast attention has its own fields (query tile, warps, stages): FastAttentionSpec
    policies: ClassVar[tuple[str, ...]] = (STRICT,)
    kv_block: int = tile(64)
    kv_split: int = tile(256)
    dot_tile: int = tile(64)
    #: "fp32": P stays float32 in P.V; "input": P is rounded to the input dtype before P.V (as
    #: GPU kernels that feed P to a bf16 matrix unit do); the row sum l always uses float32 P.
    p_precision: str = "fp32"

    def _validate(self):
        if self.kv_split % self.kv_block:
            raise SpecError(f"AttentionSpec: kv_split ({self.kv_split}) must be a multiple of kv_block "
                            f"({self.kv_block}), e.g. kv_split={self.kv_block * max(1, self.kv_split // self.kv_block)}")
        if self.p_precision not in ATTN_P_PRECISIONS:
            raise SpecError(f"AttentionSpec.p_precision must be one of {ATTN_P_PRECISIONS}, got {self.p_precision!r}")

    def _id_parts(self):
        p = "pf32" if self.p_precision == "fp32" else "pin"
        return [f"b{self.kv_block}", f"s{self.kv_split}", f"d{self.dot_tile}", p, MATH_VERSION]

    @classmethod
    def _fields_from_id(cls, parts):
        *tiles, p = _math(parts)
        return dict(_tiles(tiles, kv_block="b", kv_split="s", dot_tile="d"),
                    p_precision={"pf32": "fp32", "pin": "input"}[p])

    def describe(self):
        b, s = self.kv_block, self.kv_split
        p_words = ("P stays float32 in P.V" if self.p_precision == "fp32" else
                   "P rounded to the input dtype (then widened exactly) for P.V; l uses the float32 P")
        return [
            _policy_words(self.policy),
            "inputs widened exactly to float32; key positions are absolute (0 = first token of the sequence); "
            "GQA: query head h reads kv head h // (Hq / Hkv)",
            "visible keys of a query at position i (bottom-right aligned: i = seqlen_k - seqlen_q + row): "
            "j < seqlen_k, and j <= i if causal, and j >= i - left / j <= i + right for a window; "
            "every other key is skipped by select (an exact identity), never multiplied by a 0 mask",
            "score s_j = dot(q, k_j) * scale: " + _reduction_words("head dim", self.dot_tile)
            + "; then one float32 multiply by float32(scale) (default 1/sqrt(head_dim))",
            f"keys in splits of {s} anchored at key 0, blocks of {b} inside a split (split k = keys "
            f"[{s}k, {s}(k+1)), block = keys [{b}n, {b}(n+1)))",
            "per block, with m = running max of the split's visible scores before the block and "
            "m' = max(m, block max) (exact): p_j = exp(s_j - m'); l_blk = sequential sum of p_j from +0.0 "
            "in key order; acc_blk[d] = sequential chain acc = fma(p_j, v_j[d], acc) from +0.0 in key order; "
            + p_words,
            "running update per block in block order (a block with no visible key is skipped): "
            "alpha = exp(m - m'); l = fma(l, alpha, l_blk); acc = fma(acc, alpha, acc_blk); m = m'; "
            "start m = -inf, l = acc = +0.0",
            "split partials (m_k, l_k, acc_k) merged in split order (empty splits skipped): M' = max(M, m_k); "
            "a = exp(M - M'); c = exp(m_k - M'); L = fma(L, a, l_k * c); ACC = fma(ACC, a, acc_k * c); "
            "start M = -inf, L = ACC = +0.0; num_splits only says how many splits run in parallel",
            "out = ACC / L (correctly rounded), rounded once to the input dtype; lse = M + log(L) in float32",
            "a query with no visible key: out = 0, lse = -inf",
        ]



@dataclass(frozen=True)
class FastAttentionSpec(OpSpec):
    """Softmax attention on tensor cores (``tl.dot``: Q.K^T and P.V), every bit-deciding knob fixed here.

    The structure is the strict spec's (keys in splits of ``kv_split`` and blocks of ``kv_block``
    anchored at key 0, split partials merged in split order whatever ``num_splits`` says), so prefill,
    chunked prefill, decode, paged KV and any ``num_splits`` give the same bits on one GPU model
    (L0-L3); no L4. docs/fast_policy.md. How the kernel reaches these bits is not part of the spec: interior key
    blocks run as plain flash steps where the general step's masks and finiteness selects are identities (issue 49,
    docs/fast_policy.md "How the kernel runs the attention spec fast"); the id and the bits are unchanged.
    """

    family: ClassVar[str] = "attention"
    policies: ClassVar[tuple[str, ...]] = (FAST,)
    policy: str = FAST
    version: int = 2
    block_m: int = tile(128)   # query rows per program (also for decode: the tensor-core tile)
    kv_block: int = tile(64)
    kv_split: int = tile(512)
    num_warps: int = tile(8)
    num_stages: int = tile(2)

    def _validate(self):
        _check_dot_tiles(self, "block_m", "kv_block")
        if self.kv_split % self.kv_block:
            raise SpecError(f"FastAttentionSpec: kv_split ({self.kv_split}) must be a multiple of kv_block "
                            f"({self.kv_block})")

    def _id_parts(self):
        return [f"m{self.block_m}", f"b{self.kv_block}", f"s{self.kv_split}", f"w{self.num_warps}",
                f"st{self.num_stages}"]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(parts, block_m="m", kv_block="b", kv_split="s", num_warps="w", num_stages="st")

    def describe(self):
        b, s = self.kv_block, self.kv_split
        return [
            "policy fast: the GPU's matrix unit and its exp decide the bits inside an instruction; the structure "
            "is fixed here. Same GPU model + same Triton version + same spec => same bits (L0-L3); across GPU "
            "models, vendors or Triton versions nothing is promised (no L4)",
            "dtypes: bfloat16 and float16 (float32 refused); GQA: query head h reads kv head h // (Hq / Hkv); "
            "visible keys as the strict attention spec (absolute positions, bottom-right causal, window)",
            f"query rows in tiles of {self.block_m} per program ({self.num_warps} warps, {self.num_stages} stages); "
            "head dim zero-padded to a power of two >= 16; rows are independent",
            f"keys in splits of {s} anchored at key 0, blocks of {b} inside a split; a block with no visible key "
            "for a row leaves that row's state untouched (exact skip)",
            "per block: S = tl.dot(Q, K^T) (float32, from +0.0) * float32(scale); m' = max(m, max of the row's "
            "visible finite scores) (exact); p = tl.exp(S - m') for visible keys, 0 otherwise; "
            "l = l * alpha + tl.sum(p) (the device's reduction tree of the fixed block shape); "
            "acc = tl.dot(p rounded to the input dtype, V, acc * alpha), alpha = tl.exp(m - m')",
            "split partials merged in split order, then out = ACC / L rounded once to the input dtype and "
            "lse = M + log(L): the strict spec's merge and finish (lsm1, correctly rounded division)",
            "non-finite inputs: a row with a visible score that is not finite, or a visible key whose V row holds "
            "NaN/inf, outputs the canonical NaN (out and lse); invisible keys never affect a row (their V is "
            "zeroed where not finite); a row with no visible key: out = 0, lse = -inf",
        ]


GDN_VARIANTS = ("serial", "chunked")


@dataclass(frozen=True)
class GatedDeltaRuleSpec(OpSpec):
    """Gated delta rule (Gated DeltaNet), per value head, state S [d_k, d_v] in float32.

    ``serial``: the recurrence token by token, the state materialised after every token.
    ``chunked``: the WY/UT chunk form on a grid of ``chunk`` rows anchored at absolute position 0;
    row i of a chunk depends only on rows <= i, so a partial chunk gives its visible rows the bits
    of the full chunk. Written out in ``kernels/reference/gated_delta_rule.py``; ``docs/gated_delta_rule.md``.
    """

    family: ClassVar[str] = "gated_delta_rule"
    #: fast GDN has its own fields (operand formats, column tile, warps): FastGatedDeltaRuleSpec
    policies: ClassVar[tuple[str, ...]] = (STRICT,)
    variant: str = "chunked"
    chunk: int = tile(64)
    dk_tile: int = tile(64)

    def _validate(self):
        if self.variant not in GDN_VARIANTS:
            raise SpecError(f"GatedDeltaRuleSpec.variant must be one of {GDN_VARIANTS}, got {self.variant!r}")
        if self.variant == "serial" and self.chunk != 64:
            raise SpecError("GatedDeltaRuleSpec.chunk applies to the chunked variant only; leave it at 64 for serial")

    def _id_parts(self):
        if self.variant == "serial":
            return ["serial", f"d{self.dk_tile}", MATH_VERSION]
        return ["chunked", f"c{self.chunk}", f"d{self.dk_tile}", MATH_VERSION]

    @classmethod
    def _fields_from_id(cls, parts):
        variant, *tiles = _math(parts)
        if variant == "serial":
            return dict(variant=variant, **_tiles(tiles, dk_tile="d"))
        return dict(variant=variant, **_tiles(tiles, chunk="c", dk_tile="d"))

    def describe(self):
        dot = _reduction_words("d_k", self.dk_tile)
        return self._describe_core(dot) + [
            "companion ops (same under both variants): gdn_gating: g = -(exp(A_log) * softplus(a + dt_bias)), "
            "softplus(x) = fma(log(w), e / (w - 1), max(x, 0)) with e = exp(-|x|), w = 1 + e (= max(x, 0) + e "
            "when w == 1), beta = 1 / (1 + exp(-b)), float32 out; gdn_causal_conv1d: y_t = silu(acc), acc = "
            "fma chain from bias (or +0.0) over taps oldest first, silu(z) = z / (1 + exp(-z)) (silu(-inf) = -0.0; "
            "softplus, sigmoid and silu are the elementwise spec's), rounded once to x's dtype; its state is the "
            "previous K-1 inputs, unrounded",
        ]

    def _describe_core(self, dot):
        common = [
            _policy_words(self.policy),
            "q, k, v, g, beta widened exactly to float32; value head j reads q/k head j // (HV / H); "
            "scale = float32(scale or d_k ** -0.5)",
            "optional L2 norm of q and k: x / sqrt(ss + float32(1e-6)), ss = sum of x^2: " + dot,
            "qs = q * scale (one float32 multiply); alpha = exp(g)",
        ]
        if self.variant == "serial":
            return common + [
                "per token, in order: S' = alpha * S (elementwise); w = S'^T k: " + dot,
                "u = (v - w) * beta; S = fma(k_i, u_j, S'_ij); o = S^T qs: " + dot,
                "the float32 state after every token is the state; any split continues it exactly",
                "o rounded once to v's dtype",
            ]
        c = self.chunk
        return common + [
            f"chunks of {c} rows anchored at absolute position 0 (0 = first token of the sequence); "
            "the state S0 is materialised only at chunk boundaries; rows of an unfinished chunk are carried "
            "in the recurrent state (k after the L2 norm, v, g, beta) and recomputed by the next call",
            "log-decays: D[i, d] = g_i + g_(i-1) + ... + g_(i-d), a sequential chain from row i downward; "
            "gamma_i = exp(D[i, i]); f_ij = exp(D[i, i-j-1]) for j < i (f_ii = 1, never multiplied)",
            "KK_ij = k_i . k_j, QK_ij = qs_i . k_j, w_i = S0^T k_i, y_i = S0^T qs_i: " + dot,
            "x_i = fma(-gamma_i, w_i, v_i); forward substitution in increasing j: acc_i = x_i, "
            "for j < i: acc_i = fma(-(f_ij * KK_ij), u_j, acc_i); u_i = beta_i * acc_i",
            "o_i = gamma_i * y_i, then for j = 0..i: o_i = fma(P_ij, u_j, o_i), P_ij = f_ij * QK_ij (j < i), "
            "P_ii = QK_ii; rounded once to v's dtype",
            "state after row L (L = last row at a boundary, or the last token for a final state): "
            "S = gamma_L * S0, then for j = 0..L: S = fma(kd_j, u_j, S), kd_j = f_Lj * k_j (j < L), kd_L = k_L",
            "absent rows (after the last token) are never read by an earlier row: a partial chunk's rows "
            "have the bits of the full chunk's rows",
        ]


# ---------------------------------------------------------------- gated delta rule, fast (tensor cores)

#: How the carried float32 state enters the products with k and q (S0^T k, S0^T qs): rounded to bfloat16 (as FLA
#: does). Each format is its own id ("s" + the name); tf32 / tf32x3 would be further entries with their own budgets.
GDN_FAST_STATE_FORMATS = ("bf16",)


@dataclass(frozen=True)
class FastGatedDeltaRuleSpec(OpSpec):
    """Gated delta rule, chunked form, its products on tensor cores (``tl.dot``, bf16 operands, float32
    accumulation); everything that decides bits outside an instruction fixed here.

    The strict chunked spec's structure (a grid of ``chunk`` rows anchored at absolute position 0, a row
    reading rows <= itself only, the float32 state materialised at chunk boundaries and the open chunk's rows
    carried), so any split of a sequence into calls gives the bits of one call on one GPU model (L0-L3); no L4.
    Written out in :meth:`describe`; kernels/triton/fast_gated_delta_rule.py; docs/gated_delta_rule.md.
    """

    family: ClassVar[str] = "gated_delta_rule"
    policies: ClassVar[tuple[str, ...]] = (FAST,)
    #: the state object's form (hal/gated_delta_rule.py): a chunk grid, the open chunk's rows carried
    variant: ClassVar[str] = "chunked"
    policy: str = FAST
    version: int = 2
    chunk: int = tile(64)       # rows per chunk = rows of every row tile (also for decode: the dots' M and K)
    block_dv: int = tile(32)    # state columns per program (the dots' N)
    num_warps: int = tile(8)    # sm_90 static profile: 8 warps spill 248 B per thread, 4 warps 424 B (32 columns)
    state_format: str = "bf16"  # the state's operand format in S0^T k and S0^T qs

    def _validate(self):
        _check_dot_tiles(self, "chunk", "block_dv")
        if self.state_format not in GDN_FAST_STATE_FORMATS:
            raise SpecError(f"FastGatedDeltaRuleSpec.state_format must be one of {GDN_FAST_STATE_FORMATS}, "
                            f"got {self.state_format!r}")

    def _id_parts(self):
        return [f"c{self.chunk}", f"v{self.block_dv}", f"w{self.num_warps}", f"s{self.state_format}", MATH_VERSION]

    @classmethod
    def _fields_from_id(cls, parts):
        *tiles, state = _math(parts)
        if not state.startswith("s"):
            raise ValueError(f"{state!r} is not s<state format>")
        return dict(_tiles(tiles, chunk="c", block_dv="v", num_warps="w"), state_format=state[1:])

    def describe(self):
        c = self.chunk
        return [
            "policy fast: the GPU's matrix unit does the products and the sums inside an instruction; what "
            "decides the bits outside it is fixed here. Same GPU model + same Triton version + same spec => "
            "same bits (L0-L3); across GPU models, vendors or Triton versions nothing is promised (no L4)",
            "dtypes: q, k, v bfloat16 or float16 (float32 refused, not silently rounded); g, beta any float dtype, "
            "widened to float32; value head j reads q/k head j // (HV / H); scale = float32(scale or d_k ** -0.5)",
            "q, k widened to float32, optional L2 norm and qs = q * scale exactly as the strict spec "
            "(gated_delta_rule.strict.chunked.c64.d64.lsm1.v2, its d_k reduction order)",
            f"chunks of {c} rows anchored at absolute position 0; every row tile is {c} rows (decode too: the tile "
            "is part of the bits); rows past the last present row are zero and never reach a present row except "
            "as a product equal to zero inside a dot; the state S0 (float32) is materialised only at chunk "
            "boundaries, the open chunk's rows (k after the L2 norm, v, g, beta) are carried and recomputed",
            f"program: one (sequence, value head, {self.block_dv} state columns), {self.num_warps} warps; d_k "
            "zero-padded to a power of two >= 16 (one dot over it)",
            "log-decays, gamma_i, f_ij: the strict chunked spec's chains from row i downward and lsm1 exp",
            "KK = dot(bf16(K), bf16(K)^T), QK = dot(bf16(Qs), bf16(K)^T) [C, C]; W = dot(bf16(K), "
            f"{self.state_format}(S0)), Y = dot(bf16(Qs), {self.state_format}(S0)) [C, columns]: each one tl.dot "
            "from +0.0, float32 accumulation",
            "x_i = fma(-gamma_i, W_i, v_i); triangular solve by forward substitution in increasing j in float32: "
            "u_j = beta_j * x_j, then x_i = fma(-(f_ij * KK_ij), u_j, x_i) for i > j (the strict spec's order)",
            "o = dot(bf16(P), bf16(U'), gamma * Y): P_ij = f_ij * QK_ij (j < i), QK_ii (j = i), +0.0 (j > i); "
            "U' = U with non-finite values and absent rows set to +0.0; o_i[c] is the canonical NaN when some "
            "u_j[c], j <= i, is not finite; rounded once to v's dtype",
            "state after row L (L = C-1 at a boundary, the last token for a final state): "
            "S = dot(bf16(Kd)^T, bf16(U_L), gamma_L * S0) with Kd_j = f_Lj * k_j (j < L), k_L (j = L), rows "
            "j > L of Kd and U_L +0.0; the state carried across chunks is this float32 S",
            "every NaN output and state value is the canonical NaN (float32 0x7FC00000, bfloat16 0x7FC0, "
            "float16 0x7E00)",
        ]



@dataclass(frozen=True)
class ElementwiseSpec(OpSpec):
    """sigmoid, silu, softplus and silu_mul (SwiGLU): each value alone, in float32, with lsm1 exp/log.

    Written out in ``kernels/reference/elementwise.py``; ``docs/elementwise.md``.
    """

    family: ClassVar[str] = "elementwise"

    def _id_parts(self):
        return [MATH_VERSION]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(_math(parts))

    def describe(self):
        return [
            _policy_words(self.policy),
            "per element, independent of every other element and of its position: input widened exactly to "
            "float32, computed in float32, rounded once to the input dtype (silu_mul: a's dtype; a and b share it)",
            "sigmoid(x) = 1 / (1 + exp(-x)): negation exact, + and / correctly rounded, exp = lsm1 exp "
            "(so sigmoid(-inf) = 0, sigmoid(+inf) = 1)",
            "silu(x) = x / (1 + exp(-x)) (one correctly rounded division, not x * sigmoid(x)); silu(-inf) = -0.0",
            "softplus(x) = fma(log(w), e / (w - 1), m) with e = exp(-|x|), w = 1 + e, m = x if x > 0 else +0.0; "
            "when w == 1: m + e (log = lsm1 log; no threshold: softplus(x) is x + exp(-x) rounded for large x)",
            "silu_mul(a, b) = silu(a) * b: the float32 silu(a) above (unrounded) times float32 b, one rounding "
            "to float32, then once to the output dtype",
            "exp's argument is clamped to [-110, 100] inside lsm1 exp (exact 0 / inf beyond), so +-88, +-100, "
            "+-1e30 follow IEEE: e.g. sigmoid(-100) = 1 / inf = 0, silu(-88) is a normal float32, no flush to zero",
        ]


@dataclass(frozen=True)
class RotarySpec(OpSpec):
    """Rotary position embedding: cos/sin tables from integer positions, and the rotation of x.

    Written out in ``kernels/reference/elementwise.py`` and ``strict_math.sincos``; ``docs/elementwise.md``.
    """

    family: ClassVar[str] = "rotary"

    def _id_parts(self):
        return [MATH_VERSION]

    @classmethod
    def _fields_from_id(cls, parts):
        return _tiles(_math(parts))

    def describe(self):
        return [
            _policy_words(self.policy),
            "rotary_cos_sin(positions, R, base, inv_freq): positions int32/int64 with |pos| < 2**24 (so "
            "float32(pos) is exact; int32 and int64 give the same bits); output float32 [..., R/2]",
            "inv_freq_i (i < R/2), unless inv_freq (float32 [R/2]) is given: lb = log(float32(base)) (lsm1 log); "
            "e_i = float32(2i) / float32(R) (correctly rounded); inv_freq_i = exp(-(e_i * lb)) (product rounded "
            "once, negation exact, lsm1 exp)",
            "angle = float32(pos) * inv_freq_i, one rounding; |angle| must stay below 2**24",
            "cos/sin = lsm1 sincos: k0 = floor(fma(a, 2/pi, 0.5)), r0 = a - k0*pi/2, k = k0 + floor(fma(r0, 2/pi, 0.5)), "
            "r = a - k*pi/2 where a - k*pi/2 = fma(-k, C3, fma(-k, C2, fma(-k, C1, a))), pi/2 = C1 + C2 + C3 "
            "(float32 0x3FC90FDB, 0xB33BBD2E, 0xA6F72CED; 2/pi = 0x3F22F983)",
            "z = r*r; sin r = fma(r*z, P(z), r), P = Horner by fma of -1/3!, 1/5!, -1/7!, 1/9!, -1/11! (float32); "
            "cos r = fma(z, Q(z), 1), Q = -1/2!, 1/4!, ..., 1/12!; quadrant q = k - 4*floor(k/4): "
            "q = 0: (sin, cos) = (s, c); 1: (c, -s); 2: (-s, -c); 3: (-c, s); sin(+-0) = +-0; "
            "NaN, +-inf and |a| >= 2**24 give NaN",
            "apply_rotary(x, cos, sin, interleaved): R = 2 * cos.shape[-1] <= D; pairs (x1, x2) = (x[i], x[i + R/2]) "
            "(half-split, GPT-NeoX / HF Llama rotate_half) or (x[2i], x[2i+1]) (interleaved, GPT-J), i < R/2; "
            "x, cos, sin widened exactly to float32",
            "out1 = fma(x1, cos, -(x2 * sin)), out2 = fma(x2, cos, x1 * sin) (each product rounded once, then one "
            "fma), written back to the pair's positions; rounded once to x's dtype; dims >= R copied unchanged",
        ]


_SPECS: dict[str, OpSpec] = {}
#: The default spec for each op family (the one ops use when ``spec=`` is not given).
DEFAULTS: dict[str, OpSpec] = {}


def register(spec: OpSpec, default: bool = False) -> OpSpec:
    """Make a spec known by id (for ``hal spec show`` and golden files)."""
    _SPECS[spec.id] = spec
    if default:
        DEFAULTS[spec.family] = spec
    return spec


def get(spec_id: str) -> OpSpec:
    """The registered spec with this id (``hal spec list``); SpecError else."""
    try:
        return _SPECS[spec_id]
    except KeyError:
        raise SpecError(f"unknown spec id {spec_id!r}; known ids: {', '.join(sorted(_SPECS))} "
                        "(`hal spec list` prints them)") from None


#: Every spec class an id can name (:func:`from_id` parses their ids).
CLASSES = (MatmulSpec, FastMatmulSpec, FastMatmulV3Spec, ExactMatmulSpec, RMSNormSpec, SoftmaxSpec, TokenLogprobsSpec,
           AttentionSpec, FastAttentionSpec, GatedDeltaRuleSpec, FastGatedDeltaRuleSpec, ElementwiseSpec, RotarySpec)
_PARSED: dict[str, OpSpec | None] = {}


def from_id(spec_id: str) -> OpSpec | None:
    """The spec whose id is ``spec_id``, registered or not (e.g. ``matmul.strict.k32.v2`` is
    ``MatmulSpec(k_tile=32)``), or None when no spec class of this module makes that id at its current
    version (another version's arithmetic is not the code's). An id is the whole spec (whatever changes the
    bits changes the id), so this is what lets a spec object cross a torch op as its id and come back
    (hal/ops_registry.py ``route``): the rebuilt spec is checked to give the very same id."""
    if spec_id in _SPECS:
        return _SPECS[spec_id]
    if spec_id not in _PARSED:
        _PARSED[spec_id] = _parse(spec_id)
    return _PARSED[spec_id]


def _parse(spec_id: str) -> OpSpec | None:
    family, policy, *parts = spec_id.split(".") if spec_id.count(".") >= 2 else ("", "", "")
    for cls in CLASSES:
        if cls.family != family or policy not in cls.policies:
            continue
        try:
            spec = cls(policy=policy, **cls._fields_from_id(parts[:-1]))
        except (ValueError, KeyError, TypeError):  # not this class's form, or fields it refuses (SpecError)
            continue
        if spec.id == spec_id:
            return spec
    return None


def all_specs() -> list[OpSpec]:
    return [ _SPECS[k] for k in sorted(_SPECS)]


def resolve(family: str, spec: OpSpec | str | None) -> OpSpec:
    """The spec a call uses: the given one (object, or its id: :func:`from_id`) or the family's default."""
    if spec is None:
        return DEFAULTS[family]
    if isinstance(spec, str):
        spec = from_id(spec) or get(spec)  # any spec's id (get: the unknown-id error, listing the registered)
    if not isinstance(spec, OpSpec):
        raise SpecError(f"spec must be an OpSpec or a spec id string, got {type(spec).__name__}")
    if spec.family != family:
        raise SpecError(f"spec {spec.id} is for {spec.family!r} ops, but this is a {family!r} op; "
                        f"pass a {family} spec such as {DEFAULTS[family].id}")
    return spec


register(MatmulSpec(), default=True)
register(FastMatmulSpec())  # tensor cores (triton backend): docs/fast_policy.md
register(FastMatmulSpec(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2))  # small tiles: CI, many K tiles
register(FastMatmulV3Spec())  # opt-in: its tile freedom is a hypothesis until the device sweep answers
register(ExactMatmulSpec(slices=3))  # selectable, not default: docs/exact_matmul.md has the measurements
register(ExactMatmulSpec(slices=4))
register(RMSNormSpec(), default=True)
register(SoftmaxSpec(), default=True)
register(TokenLogprobsSpec(), default=True)
register(TokenLogprobsSpec(matmul=ExactMatmulSpec(slices=4)))  # order-free logits (docs/exact_matmul.md)
register(TokenLogprobsSpec(matmul=FastMatmulSpec()))  # tensor-core logits, strict log-softmax: docs/fast_policy.md
register(AttentionSpec(), default=True)
register(AttentionSpec(kv_block=16, kv_split=64))  # small tiles: many blocks/splits at short lengths
register(AttentionSpec(p_precision="input"))
register(AttentionSpec(kv_block=16, kv_split=64, p_precision="input"))
register(FastAttentionSpec())  # tensor cores (triton backend): docs/fast_policy.md
register(FastAttentionSpec(block_m=16, kv_block=16, kv_split=64, num_warps=4))  # small tiles: CI, many blocks/splits
#: fast attention with a decode-sized query tile (issue 49), opt-in: ``spec=`` on the attention ops (or its id), or
#: ``specs={"attention": FAST_ATTENTION_DECODE}`` on the policy switch. 16 rows is the smallest tensor-core dot
#: (``tl.dot`` needs M >= 16; on sm_90 a 16-row dot is mma.sync m16n8k16, wgmma needs 64), and a decode tile packs a
#: GQA group's query heads: 4-8 heads x 1-4 rows fill 4-16 of its 16 rows, 3-25 % of the default's 128. 8 warps, as
#: the default: the K and V blocks (64 keys x the head dim), not the 16 rows, fill the registers. Compiled for sm_90 by
#: Triton 3.9 (D 128, bf16; no GPU, 3.6 not checked): the paged split-KV decode kernel has no local stack on 8 warps,
#: 136 B on 4, 256 B on 2; the prefill tile 16 B on 8, 1744 B on 4 (docs/fast_policy.md). Blocks of 64 and splits of
#: 512 keys as the default. A new id, not a decode heuristic: the tile shape decides the dot's instruction and the row
#: sum's reduction tree, so its bits may differ from the default's; prefill, chunked prefill, decode, paged caches and
#: any num_splits give the same bits *within* it, its prefill on 16-row tiles (slower than the default's): one spec
#: for the trainer and the sampler both.
FAST_ATTENTION_DECODE = register(FastAttentionSpec(block_m=16))
register(GatedDeltaRuleSpec(variant="chunked"), default=True)
register(GatedDeltaRuleSpec(variant="serial"))
#: the fast policy's gated delta rule spec (tensor cores, triton backend; docs/gated_delta_rule.md): what a fast switch
#: passes as ``spec=`` to chunk_gated_delta_rule / fused_recurrent_gated_delta_rule (its id works as well)
GDN_FAST = register(FastGatedDeltaRuleSpec())
register(ElementwiseSpec(), default=True)
register(RotarySpec(), default=True)

#: The spec of each op family under a policy switch -- ``hal.use(policy=...)``, ``lt.patch(model, policy=...)``,
#: TorchTitan's ``LockstepConverter.Config(policy=...)`` (docs/fast_policy.md, "One switch for a whole model").
#: A family a policy's table leaves out runs its strict default (``DEFAULTS``): under fast, today, every family
#: but matmul, attention, gated_delta_rule and token_logprobs (its logits; its log-softmax stays strict): there is
#: no fast rms_norm, softmax, ... spec. The one home of that choice: a new fast spec joins its policy's table in one
#: line. Keyed by family (a spec is a family's), the
#: entry reaches the family's ops that a conformance suite checks under it (an op's record lists its suites:
#: ``hal.dispatch.switched_spec``): the gated delta rule's two ops run GDN_FAST, while the GDN layer ops of the
#: same family (gdn_gating, gdn_causal_conv1d: suite gdn_layer, strict only) keep the strict default.
POLICY_SPECS: dict[str, dict[str, OpSpec]] = {
    STRICT: {},
    FAST: {
        "matmul": get("matmul.fast.m128.n128.k64.w8.s3.v2"),
        "attention": get("attention.fast.m128.b64.s512.w8.st2.v2"),
        "gated_delta_rule": GDN_FAST,
        "token_logprobs": get("token_logprobs.strict.fast-m128-n128-k64-w8-s3-v2.v256.lsm1.v2"),
    },
    EXACT: {  # the exact matmul with 4 slices (docs/exact_matmul.md), and the token_logprobs whose logits use it
        "matmul": get("matmul.exact.s4.v2"),
        "token_logprobs": get("token_logprobs.strict.exact-s4.v256.lsm1.v2"),
    },
}


def policy_specs(policy: str, chosen: dict | None = None) -> dict[str, OpSpec]:
    """A switch's table: ``POLICY_SPECS[policy]`` with the entries of ``chosen`` (family -> spec or its id) in place of
    the registered ones, e.g. ``{"attention": FAST_ATTENTION_DECODE}`` (``specs=`` of ``hal.use(policy=...)`` and
    ``lt.patch(model, policy=...)``). A chosen spec must replace an entry the policy's table has (so it reaches the ops
    that family's spec is checked for, ``hal.dispatch.switched_spec``), be of that family and be the policy's own
    (a strict spec under fast would run strict where the switch promises fast): SpecError naming it otherwise."""
    if policy not in POLICY_SPECS:
        raise SpecError(f"policy must be one of {tuple(POLICY_SPECS)}, got {policy!r}")
    table = dict(POLICY_SPECS[policy])
    if chosen is None:
        return table
    if not isinstance(chosen, dict):
        raise SpecError(f"specs= must be a dict of family -> spec (or spec id), e.g. {{'attention': "
                        f"{FAST_ATTENTION_DECODE.id!r}}}, got {type(chosen).__name__}")
    for family, spec in chosen.items():
        if family not in table:
            raise SpecError(f"specs={{{family!r}: ...}}: policy {policy!r} has no {family!r} spec to replace (its "
                            f"families: {', '.join(sorted(table)) or 'none'})")
        s = resolve(family, spec)  # an unknown id, another family's spec: SpecError naming them
        if policy not in s.policies_used():
            raise SpecError(f"specs={{{family!r}: {s.id!r}}}: not a {policy!r} spec (it uses "
                            f"{', '.join(sorted(s.policies_used()))}); the {policy} switch's {family} spec is "
                            f"{table[family].id}")
        table[family] = s
    return table


def policy_spec(family: str, policy: str, table: dict | None = None) -> OpSpec:
    """The spec of ``family`` under ``policy``'s switch: the policy's own where its table has one (``table``: a
    :func:`policy_specs` table, default ``POLICY_SPECS[policy]``), else the family's strict default. Which of the
    family's ops take it: ``hal.dispatch.switched_spec`` (per op)."""
    if policy not in POLICY_SPECS:
        raise SpecError(f"policy must be one of {tuple(POLICY_SPECS)}, got {policy!r}")
    return (POLICY_SPECS[policy] if table is None else table).get(family) or DEFAULTS[family]
