"""numba kernels of the `cpu` backend: the strict specs' exact arithmetic, compiled (see docs/cpu_backend.md).

numba's on-disk cache (``cache=True``) is keyed on the stamp of the file that defines a kernel only:
a change to a helper it inlines from another file (strict_math, reduce, host) would leave stale
machine code in place, i.e. stale bits. So the cache of this package is tied to a hash of all its
sources: when the hash changes, the package's cache files are removed before any kernel loads.
"""
from __future__ import annotations

import hashlib
import pathlib

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
            if folder == _HERE / "__pycache__":  # numba's first choice; the others only once numba made them
                folder.mkdir(exist_ok=True)
            if folder.is_dir():
                stamp.write_text(digest)
        except OSError:  # a read-only install: numba then uses the other folder
            pass


drop_stale_cache()
