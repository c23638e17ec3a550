"""A worker extension as verl / OpenRLHF attach their weight sync (``LLM(worker_extension_cls=...)``): its own
method loads new weights into the worker's model (here from a checkpoint file; theirs from a broadcast)."""
from __future__ import annotations


class WeightSyncExtension:
    def lockstep_test_load(self, path: str) -> None:
        from safetensors.torch import load_file
        self.model_runner.model.load_weights(load_file(path).items())
