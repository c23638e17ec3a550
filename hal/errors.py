"""Errors raised by lockstep. Each one says what is wrong and how to fix it.

Under ``torch.compile`` a refusal met while compiling (a check in the Python that Dynamo traces, e.g. a
prepared weight handed to a torch op, or real code run during the compile: a fake kernel, an autograd
``setup_context``) must reach the user as the class and message it has eagerly. Dynamo does not give that
for free: it cannot trace an exception constructor that calls ``super().__init__``, with ``fullgraph=True``
it turns an exception raised by traced code into its own ``Unsupported("Observed exception")``, and it
wraps one raised by real code in its ``TorchRuntimeError``. So a lockstep error constructed while a compile
is under way raises right away, from a real (untraced) call, as :func:`_compile_time_class` of its class:
a subclass with the same name, attributes and ``str()`` that is also Dynamo's ``Unsupported``, which Dynamo
hands to the user unchanged (``except hal.UnsupportedError`` catches it). With ``fullgraph=False`` that is
a graph break, and the user gets the error when that code runs. One mechanism, in the base class, for
every lockstep error. Its limit: code that Dynamo traces cannot catch a lockstep error (the compile ends
with it instead); real code can (the compile-time form is an instance of the class).
"""
from __future__ import annotations

import torch


class HalError(Exception):
    """Base class of every lockstep error."""

    def __init__(self, *args):
        # No super().__init__ (Dynamo cannot trace it): BaseException.__new__ has set self.args already.
        if torch.compiler.is_dynamo_compiling() or torch.compiler.is_compiling():
            _raise_compile_time(type(self), args)  # traced: a real call, see below; real code under a compile
        self._setup(*args)

    def _setup(self, *args) -> None:
        """What the constructor sets, eagerly (a subclass with more than a message overrides it)."""


class InputError(HalError, ValueError):
    """A tensor argument has the wrong shape, dtype, device or layout."""


class SpecError(HalError, ValueError):
    """A spec is unknown or invalid."""


class BackendUnavailable(HalError, RuntimeError):
    """A backend was named that cannot run here (missing dependency or device)."""


class UnsupportedError(HalError, RuntimeError):
    """No backend (or not the requested one) can serve this call. Carries every reason."""

    def __init__(self, message: str, reasons: list[str] | None = None):
        HalError.__init__(self, message, reasons)

    def _setup(self, message: str, reasons: list[str] | None = None) -> None:
        self.reasons = list(reasons or [])
        if self.reasons:
            message = message + "\n" + "\n".join(f"  - {r}" for r in self.reasons)
        self.args = (message,)


class GoldenError(HalError, RuntimeError):
    """A golden file is missing, corrupt or stale."""


# ---------------------------------------------------------------- refusals met while compiling


def _raise_compile_time(cls: type, args: tuple):
    """Called for real with the error's class and arguments (by Dynamo instead of tracing it, see below, or
    by real code that runs while a compile is under way: a fake kernel, an autograd ``setup_context``):
    builds the error eagerly and raises its compile-time form, carrying the same attributes; or the error
    itself when no compile is under way (code Dynamo compiled with the check folded in, now running)."""
    err = cls.__new__(cls, *args)
    err._setup(*args)
    if not torch.compiler.is_compiling():
        raise err
    raise _compile_time_class(cls)(err)


# What torch._dynamo.assume_constant_result sets (tests/test_compile_refusals.py checks that it still is):
# Dynamo then calls the function with the constant arguments instead of tracing it. Set by hand so that
# importing hal does not import torch._dynamo (9-10 s measured on the loaded 2-core CI machine).
_raise_compile_time._dynamo_marked_constant = True


_COMPILE_TIME: dict[type, type] = {}


def _compile_time_class(cls: type) -> type:
    """``cls`` as Dynamo lets it through: also a ``torch._dynamo.exc.Unsupported``, which convert_frame
    re-raises and eval_frame hands to the caller as it is (other exceptions it wraps in its own types).
    Same name, same ``str()`` (Dynamo appends its "from user code" trace to ``args[0]``, not to ours)."""
    if cls in _COMPILE_TIME:
        return _COMPILE_TIME[cls]
    from torch._dynamo.exc import Unsupported

    def __init__(self, err):
        Unsupported.__init__(self, str(err))
        self.__dict__.update(err.__dict__)
        self.args, self.message = err.args, str(err)

    def __str__(self):
        return self.message

    made = _COMPILE_TIME[cls] = type(cls.__name__, (cls, Unsupported), {
        "__init__": __init__, "__str__": __str__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__})
    return made
