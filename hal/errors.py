"""Errors raised by lockstep. Each one says what is wrong and how to fix it."""


class HalError(Exception):
    """Base class of every lockstep error."""


class InputError(HalError, ValueError):
    """A tensor argument has the wrong shape, dtype, device or layout."""


class SpecError(HalError, ValueError):
    """A spec is unknown or invalid."""


class BackendUnavailable(HalError, RuntimeError):
    """A backend was named that cannot run here (missing dependency or device)."""


class UnsupportedError(HalError, RuntimeError):
    """No backend (or not the requested one) can serve this call. Carries every reason."""

    def __init__(self, message: str, reasons: list[str] | None = None):
        self.reasons = list(reasons or [])
        if self.reasons:
            message = message + "\n" + "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(message)


class GoldenError(HalError, RuntimeError):
    """A golden file is missing, corrupt or stale."""
