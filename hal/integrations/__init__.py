"""Adapters that plug lockstep's ops into other libraries, one folder (or module) per framework:
``transformers/`` (``lt.patch`` and its verify / audit, the HF module forwards, attention and matmul routes, the
continuous-batching engine shim and its installer, the tiny test models), ``torchtitan/`` (the converter and its
module files), ``vllm/`` (the plugin), ``trl.py``, and ``_versions.py`` (the shared version check). Each imports
its library lazily."""
from ..deprecation import alias_moved_modules

# The flat module paths before issue 47, kept one release (hal.deprecation.REMOVED_IN): each is the new module.
MOVED = {
    "hf_attention": "hal.integrations.transformers.attention",
    "hf_engine": "hal.integrations.transformers.engine",
    "hf_engine_install": "hal.integrations.transformers.engine_install",
    "hf_matmul": "hal.integrations.transformers.matmul",
    "hf_modules": "hal.integrations.transformers.modules",
    "hf_testing": "hal.integrations.transformers.testing",
    "hf_verify": "hal.integrations.transformers.verify",
    "titan_modules": "hal.integrations.torchtitan.modules",
    "titan_qwen35_modules": "hal.integrations.torchtitan.qwen35_modules",
}
__getattr__ = alias_moved_modules(__name__, MOVED)
