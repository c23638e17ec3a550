"""benchmarks/vllm_step_profile.py's counting (no vLLM: the engine run is the benchmark's, never asserted here):
a profiled serving-core call is summarised into ops with their calls and the lockstep function that issued them."""
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import vllm_step_profile as vsp
from hal.serving import PagedKV, ServingBatch, request_kv


def test_ops_are_counted_and_attributed_to_the_lockstep_function_that_issued_them():
    cache = PagedKV(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8))
    batch = ServingBatch(torch.tensor([0, 1, 2]), torch.tensor([5, 3]), torch.tensor([[4, 1], [0, -1]]))
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        keys, values = request_kv(cache, batch)
    s = vsp.summarise(prof, 0.001)
    ops = {name: calls for name, calls, _ in s["by_op"]}
    issuers = {name: calls for name, calls, _ in s["by_issuer"]}
    assert ops["aten::index"] >= 2  # the keys' and the values' gathers (and the block table's)
    assert issuers.get("kernels/layout.py:paged_token_coords", 0) > 0 and issuers.get("hal/serving.py:request_kv", 0) > 0
    assert s["ops_calls"] == sum(ops.values()) == sum(issuers.values())
    assert "other" not in issuers  # every op here was issued by lockstep code


def test_thread_cpu_time_sees_a_busy_thread_by_name():
    """--thread-steps' per-thread CPU time: a Python thread that spins during the steps shows up by its name with
    about the steps' wall time; one that sleeps does not (the control)."""
    import threading
    import time
    stop, spin_for = threading.Event(), 0.05

    def spin():
        while not stop.is_set():
            pass
    busy = threading.Thread(target=spin, name="busy-spinner")
    idle = threading.Thread(target=stop.wait, name="idle-waiter")
    busy.start(), idle.start()
    try:
        res = vsp.per_step_threads(lambda: time.sleep(spin_for), 4)
    finally:
        stop.set()
        busy.join(), idle.join()
    used = dict(res["threads"])
    assert res["steps"] == 4 and res["median_wall_ms"] >= spin_for * 1000
    assert used.get("busy-spinner", 0) > 0.3 * spin_for * 1000, res
    assert "idle-waiter" not in used, res
