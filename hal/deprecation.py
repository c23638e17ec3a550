"""The one place deprecated names are announced: every alias lockstep keeps after a rename warns through here, so
each warning (and the docs that list the aliases) states the same release that removes it.

The aliases are kept for one release: those deprecated during 0.2.x go in ``REMOVED_IN``.
tests/test_deprecated_aliases.py checks that this release is still ahead of the package's version (pyproject.toml), so the release that reaches it
fails until the aliases are gone.
"""
from __future__ import annotations

import warnings

__all__ = ["REMOVED_IN", "warn_moved", "alias_moved_modules"]

#: the release that removes every alias deprecated so far
REMOVED_IN = "0.3.0"


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    """DeprecationWarning ``"<old> is deprecated: use <new> (<old> is removed in lockstep REMOVED_IN)"``; the default
    ``stacklevel`` points at the caller of the function (or module ``__getattr__``) that calls this."""
    warnings.warn(f"{old} is deprecated: use {new} ({old} is removed in lockstep {REMOVED_IN})", DeprecationWarning,
                  stacklevel=stacklevel)


class _MovedModules:
    """A ``sys.meta_path`` finder for module paths that moved: ``import <old>`` returns the module object of
    ``<new>`` (registered under both names, so a monkeypatch through the old path patches the real module, and
    no second copy with its own state exists) and warns once per old name."""

    def __init__(self, moves: dict[str, str]):
        self.moves = dict(moves)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moves:
            return None
        import importlib.machinery
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        import importlib
        new = self.moves[spec.name]
        warn_moved(spec.name, new, stacklevel=4)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:  # the new module ran already, under its own name
        pass


def alias_moved_modules(package: str, moves: dict[str, str]):
    """Keep ``package.<old>`` importable for one release as the module ``moves[old]`` (a dotted name), with a
    DeprecationWarning; returns the package's module ``__getattr__`` for ``package.<old>`` attribute access."""
    import importlib
    import sys
    finder = _MovedModules({f"{package}.{old}": new for old, new in moves.items()})
    if not any(isinstance(f, _MovedModules) and f.moves == finder.moves for f in sys.meta_path):
        sys.meta_path.append(finder)

    def __getattr__(name: str):  # ``from package import <old>`` / ``package.<old>`` before any import of it
        if name not in moves:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        old = f"{package}.{name}"
        if old not in sys.modules:
            module = importlib.import_module(moves[name])
            warn_moved(old, moves[name])
            sys.modules[old] = module
            setattr(sys.modules[package], name, module)
        return sys.modules[old]
    return __getattr__
