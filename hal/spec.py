"""Op specs: frozen, hashable descriptions of a canonical computation.

A spec fixes everything that decides the bits of an op's output: the precision policy, the tile
size along every reduction axis, the order partial results are combined in, the accumulation and
output dtypes, and where rounding happens. Two calls with equal specs and equal inputs must give
equal bits on every backend that supports the spec (the L4 promise of the `strict` policy).

Every spec has a stable, human-readable id derived from its fields, e.g. ``matmul.strict.k64.v1``.
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
* results are rounded once, to the output dtype, round-to-nearest-even; no flush to zero.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from .errors import SpecError

STRICT = "strict"
FAST = "fast"
POLICIES = (STRICT, FAST)

#: Version tag of lockstep's own exp/log (kernels/reference/strict_math.py). Part of every id of a
#: spec that uses them: a new polynomial means new bits and so a new id.
MATH_VERSION = "lsm1"


@dataclass(frozen=True)
class OpSpec:
    """Base of all specs. Subclasses add the fields that decide their bits."""

    family: ClassVar[str] = ""
    policy: str = STRICT
    version: int = 1

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise SpecError(f"{type(self).__name__}: policy must be one of {POLICIES}, got {self.policy!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("tile") and (not isinstance(v, int) or v <= 0):
                raise SpecError(f"{type(self).__name__}.{f.name} must be a positive int, got {v!r}")
        self._validate()

    def _validate(self) -> None:  # subclasses check their own invariants
        pass

    def _id_parts(self) -> list[str]:
        raise NotImplementedError

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


def _reduction_words(axis: str, t: int) -> str:
    return (f"reduction over {axis}: tiles of {t} anchored at index 0; a sequential fma chain from +0.0 "
            f"inside each tile; tile partials added in increasing tile order from +0.0")


def _policy_words(policy: str) -> str:
    if policy == STRICT:
        return ("policy strict: IEEE float32 fma, +, -, /, sqrt only, each rounded to nearest even; "
                f"lockstep's own exp/log ({MATH_VERSION}); no flush-to-zero; same bits on every backend (L4)")
    return ("policy fast: vendor matrix units and vendor math allowed inside a backend; tiling and "
            "combine order still fixed (L0-L3 within one backend and device type)")


@dataclass(frozen=True)
class MatmulSpec(OpSpec):
    """``out[m, n] = sum_k a[m, k] * b[k, n]`` (+ bias), accumulated in float32."""

    family: ClassVar[str] = "matmul"
    k_tile: int = tile(64)

    def _id_parts(self):
        return [f"k{self.k_tile}"]

    def describe(self):
        return [
            _policy_words(self.policy),
            "inputs widened exactly to float32",
            _reduction_words("K", self.k_tile),
            "linear: bias (float32) added once after the K reduction",
            "output rounded once to the input dtype",
        ]


@dataclass(frozen=True)
class RMSNormSpec(OpSpec):
    """``y = x / sqrt(mean(x^2) + eps) * w``; with a residual, ``h = x + r`` is normalised."""

    family: ClassVar[str] = "rms_norm"
    hidden_tile: int = tile(256)

    def _id_parts(self):
        return [f"h{self.hidden_tile}"]

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

    def describe(self):
        return [
            _policy_words(self.policy),
            "inputs widened exactly to float32",
            f"tiles of {self.tile} along the axis, anchored at index 0; M = max of the row (exact, order-free)",
            f"per tile: s_t = sequential sum from +0.0 of exp(x - M) over the tile's elements",
            "S = tile partials s_t added in increasing tile order from +0.0",
            "logsumexp = M + log(S); log_softmax = (x - M) - log(S); softmax = exp(x - M) / S",
            "a row that is all -inf (fully masked): logsumexp -inf, log_softmax -inf, softmax 0; "
            "a NaN or +inf anywhere in a row makes every output of that row NaN",
            "softmax/log_softmax rounded once to the input dtype; logsumexp likewise",
        ]


@dataclass(frozen=True)
class TokenLogprobsSpec(OpSpec):
    """log p(token) from hidden states and an LM head: fp32 logits, vocab-tiled log-softmax."""

    family: ClassVar[str] = "token_logprobs"
    hidden_tile: int = tile(64)
    vocab_tile: int = tile(256)

    def _id_parts(self):
        return [f"h{self.hidden_tile}", f"v{self.vocab_tile}", MATH_VERSION]

    def describe(self):
        return [
            _policy_words(self.policy),
            "logits[n, v] = hidden[n] . W[v] in float32: " + _reduction_words("hidden", self.hidden_tile),
            "temperature: logits / T (correctly rounded division; skipped bit-exactly when T == 1)",
            f"log-softmax over the vocab as the softmax spec with tile {self.vocab_tile}",
            "output: float32 (x_token - M) - log(S), never rounded to a lower precision",
        ]


# --- attention specs (issue 3) ---

# --- gated delta rule specs (issue 4) ---


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
    try:
        return _SPECS[spec_id]
    except KeyError:
        raise SpecError(f"unknown spec id {spec_id!r}; known ids: {', '.join(sorted(_SPECS))} "
                        "(`hal spec list` prints them)") from None


def all_specs() -> list[OpSpec]:
    return [ _SPECS[k] for k in sorted(_SPECS)]


def resolve(family: str, spec: OpSpec | str | None) -> OpSpec:
    """The spec a call uses: the given one (object or id) or the family's default."""
    if spec is None:
        return DEFAULTS[family]
    if isinstance(spec, str):
        spec = get(spec)
    if not isinstance(spec, OpSpec):
        raise SpecError(f"spec must be an OpSpec or a spec id string, got {type(spec).__name__}")
    if spec.family != family:
        raise SpecError(f"spec {spec.id} is for {spec.family!r} ops, but this is a {family!r} op; "
                        f"pass a {family} spec such as {DEFAULTS[family].id}")
    return spec


register(MatmulSpec(), default=True)
register(RMSNormSpec(), default=True)
register(SoftmaxSpec(), default=True)
register(TokenLogprobsSpec(), default=True)
# --- attention spec registrations ---
# --- gated delta rule spec registrations ---
