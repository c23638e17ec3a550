"""numba kernels of the `cpu` backend: the strict specs' exact arithmetic, compiled (see docs/cpu_backend.md).

numba's on-disk cache (``cache=True``) is keyed on the stamp of the file that defines a kernel only:
a change to a helper it inlines from another file (strict_math, reduce, host) would leave stale
machine code in place, i.e. stale bits. So the cache of this package is tied to a hash of all its
sources: when the hash changes, the package's cache files are removed before any kernel loads.

Compiling takes seconds per kernel (minutes for the whole package on a small machine), so the first
compile in a process prints one line saying so (:func:`announce_compiles`).
"""
from __future__ import annotations

import hashlib
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
_STAMP = "lockstep-sources.sha256"


def _sources_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cache_dirs() -> list[pathlib.Path]:
    """Where numba may keep this package's cache: in the tree, numba's user-wide folder, or CACHE_DIR."""
    dirs = [_HERE / "__pycache__"]
    try:
        from numba import config
        from numba.core import caching
        kinds = [caching.UserWideCacheLocator] + ([caching.UserProvidedCacheLocator] if config.CACHE_DIR else [])
        dirs += [pathlib.Path(k(_sources_hash, str(_HERE / "host.py")).get_cache_path()) for k in kinds]
    except (ImportError, AttributeError):  # numba's internals moved: the in-tree folder is still checked
        pass
    return dirs


def drop_stale_cache() -> None:
    digest = _sources_hash()
    for folder in _cache_dirs():
        stamp = folder / _STAMP
        try:
            if stamp.read_text() == digest:
                continue
        except OSError:
            pass
        try:
            for f in list(folder.glob("*.nbi")) + list(folder.glob("*.nbc")):
                f.unlink(missing_ok=True)
            # a folder not made yet holds no kernels, so it is in step with these sources: stamped now.
            # Left unstamped, the next process would take numba's new files there for stale ones, drop
            # them and compile everything a second time (seen with NUMBA_CACHE_DIR).
            folder.mkdir(parents=True, exist_ok=True)
            stamp.write_text(digest)
        except OSError:  # a read-only install: numba then uses the other folder
            pass


#: what the backend is computing (set by backends/cpu.py before each compiled call): named in the notice
current_op = None
_announced = False


def cache_location() -> str:
    from numba import config
    return config.CACHE_DIR or str(_HERE / "__pycache__")


def _notice(kernel: str) -> str:
    what = f"for {current_op}" if current_op else f"({kernel})"
    return (f"lockstep: compiling the cpu backend's numba kernels {what}: once per machine, then loaded from "
            f"the disk cache ({cache_location()}); `hal warmup` compiles them ahead of time")


#: where compile events go instead of the one line on stderr: ``sink(kernel, notice)`` at the start of each
#: compile of one of this package's kernels, ``notice`` the one-line text at the first one in the process
#: (else None). A progress display (``hal conformance run``) sets it to show the compiles in its own output.
compile_sink = None


def announce_compiles() -> None:
    """Print one line to stderr at the first numba compile of one of this package's kernels in this
    process (a numba event: loads from the disk cache are silent), or hand every compile to
    :data:`compile_sink` when one is set. Idempotent."""
    try:
        from numba.core import event
    except ImportError:  # no numba: nothing here compiles (the backend says it is unavailable)
        return

    class _FirstCompile(event.Listener):
        def on_start(self, ev):
            global _announced
            d = ev.data["dispatcher"]
            if not d.py_func.__module__.startswith(__name__):
                return
            kernel = f"{d.py_func.__module__.removeprefix(__name__ + '.')}.{d.py_func.__qualname__}"
            notice = None if _announced else _notice(kernel)
            _announced = True
            if compile_sink is not None:
                compile_sink(kernel, notice)
            elif notice is not None:
                print(notice, file=sys.stderr, flush=True)

        def on_end(self, ev):
            pass

    global _listener
    if _listener is None:
        _listener = _FirstCompile()
        event.register("numba:compile", _listener)


_listener = None
drop_stale_cache()
announce_compiles()
