"""Compute kernels. ``kernels.reference`` is the readable definition of every strict spec;
``kernels.oracle`` holds the float64 oracles used for the accuracy level A.

Installed, this folder is ``hal.kernels``. Imported as the top-level name ``kernels`` (Python run from a clone's
root puts this folder on the path ahead of site-packages), the caller means another distribution: Hugging Face's
``kernels``, which transformers >= 5.25 requires and imports. When one is installed it is loaded in this module's
place, so a clone's root does not shadow it; when none is, this module stays (no ``__version__``: transformers'
availability check reads it as "not installed", as before).
"""
if __name__ == "kernels":
    def _load_the_other_kernels():
        import importlib.machinery
        import importlib.util
        import os
        import sys
        clone = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != clone]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # importlib returns this entry to the importer
        spec.loader.exec_module(module)

    _load_the_other_kernels()
    del _load_the_other_kernels
