"""transformers' engine and weight updates: the prefix cache and the mid-flight refusal use the weight detector.

A persistent manager (``generate_batch(..., persistent_manager=True)``) with block sharing on (transformers'
default) fills its prefix cache; the weights are updated with every kind (fused, foreach and loop AdamW and
SGD, ``p.data.copy_``, ``p.data =``, ``load_state_dict`` plain and ``assign=True``, writes through
``state_dict()``, a 2-process gloo broadcast into ``p.data``); the same prompts run again: tokens and recorded
log-prob bits equal a fresh engine on the new weights. Negative control: the old ``(data_ptr, _version)``
check put back into the engine serves stale prefix blocks after the writes it cannot see. Mid-flight: a fused
AdamW step while a request decodes is refused (the old check lets the request finish on mixed weights).
"""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

pytest.importorskip("transformers")

from hal.integrations.transformers import engine as hf_engine  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import tiny_model  # noqa: E402
from examples.engine_parity import EASY, PROMPTS, gen_config, run_engine  # noqa: E402
from test_weight_watch import OLD_CHECK_BLIND, UPDATES, old_check  # noqa: E402

CB = dict(page_size=4, num_blocks=64, max_batch_tokens=64, allow_block_sharing=True)
SHARED = [PROMPTS[0], PROMPTS[2]]  # a 9-token common prefix: two full shared blocks


class OldCheck:
    """The engine's check before the detector, in the detector's interface (the negative control)."""

    def __init__(self, model):
        self.model = model

    def stamp(self):
        return _OldStamp(old_check(self.model))

    def quick_changed(self, since):
        return True  # the old engine compared its pair on every step


class _OldStamp:
    def __init__(self, version):
        self.version = version

    def same_bits(self, other):
        return self.version == other.version


def same_runs(a, b) -> bool:
    return sorted(a) == sorted(b) and all(
        a[i][0] == b[i][0] and torch.equal(a[i][1].view(torch.int32), b[i][1].view(torch.int32)) for i in a)


def fresh_engine(model):
    """A fresh model holding ``model``'s weights, in a fresh engine."""
    fresh = tiny_model("llama")
    fresh.load_state_dict(model.state_dict())
    assert all(torch.equal(p.view(torch.int32), q.view(torch.int32))
               for p, q in zip(model.parameters(), fresh.parameters()))
    with lt.patch(fresh):
        return run_engine(fresh, SHARED, CB)[0]


def kept_engine_across(update, model):
    """Fill a persistent engine's prefix cache, ``update(model)``, run the same prompts again in it."""
    with lt.patch(model):
        before, steps, _ = run_engine(model, SHARED, CB, persistent=True)
        try:
            update(model)
            after, _, _ = run_engine(model, SHARED, CB, persistent=True)
        finally:
            model.destroy_cached_continuous_batching_manager()
    return before, after


@pytest.fixture(scope="module")
def registered():
    lt.register()


@pytest.mark.parametrize("kind", sorted(UPDATES))
def test_kept_engine_after_every_update_kind_equals_a_fresh_engine(registered, kind):
    model, donor = tiny_model("llama"), tiny_model("llama", seed=1)
    before, after = kept_engine_across(lambda m: UPDATES[kind](m, donor), model)
    want = fresh_engine(model)
    assert not same_runs(before, want), "the update changed no result"
    assert same_runs(after, want), kind


@pytest.mark.parametrize("kind", sorted(OLD_CHECK_BLIND))
def test_negative_control_old_check_serves_stale_prefix_blocks(registered, monkeypatch, kind):
    monkeypatch.setattr(hf_engine, "ModelWeights", OldCheck)
    model, donor = tiny_model("llama"), tiny_model("llama", seed=1)
    _, after = kept_engine_across(lambda m: UPDATES[kind](m, donor), model)
    assert not same_runs(after, fresh_engine(model))


def _decoding_request_with_fused_step(model):
    """One request; once it decodes, the engine thread waits in its step hook while this thread runs a fused
    AdamW step; then the engine goes on. Returns the request's output (its ``error`` says if it was refused)."""
    from hal.integrations.transformers.testing import continuous_batching_config
    decoding, updated = threading.Event(), threading.Event()

    def hook(step):
        if step.decoding and not decoding.is_set():
            decoding.set()
            assert updated.wait(120)
    hf_engine.step_hooks(model).append(hook)
    manager = model.init_continuous_batching(gen_config(), continuous_batching_config(return_logprobs=True, **EASY))
    manager.start()
    try:
        manager.add_request(PROMPTS[0], request_id="req_0")
        assert decoding.wait(120), "the request never decoded"
        UPDATES["AdamW-fused"](model, None)
        updated.set()
        out = manager.get_result(timeout=120)
        assert out is not None
        return out
    finally:
        manager.stop(block=True)
        hf_engine.step_hooks(model).remove(hook)


def test_fused_step_while_a_request_decodes_is_refused(registered, monkeypatch):
    model = tiny_model("llama")
    with lt.patch(model):
        out = _decoding_request_with_fused_step(model)
    assert out.error is not None and "weights changed while the engine had running requests" in out.error
    assert "model.embed_tokens.weight" in out.error  # names what changed (a fused step moved every weight)
    # negative control: the old check lets the request finish on mixed weights, no error
    monkeypatch.setattr(hf_engine, "ModelWeights", OldCheck)
    model = tiny_model("llama")
    with lt.patch(model):
        out = _decoding_request_with_fused_step(model)
    assert out.error is None and len(out.generated_tokens) > 1


# ---------------------------------------------------------------- a torch.distributed broadcast into p.data


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_worker(rank, world, port, out_path):
    import torch.distributed as dist
    torch.set_num_threads(1)
    lt.register()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = {}
        for check in ("detector", "old"):
            if check == "old":
                hf_engine.ModelWeights = OldCheck  # this process only (spawned)
            model = tiny_model("llama", seed=rank)  # rank 1's weights differ until the sync
            if rank == 0:
                for p in model.parameters():
                    dist.broadcast(p.data, src=0)
                continue

            def sync(m):
                with torch.no_grad():
                    for p in m.parameters():
                        dist.broadcast(p.data, src=0)  # a weight sync: rank 0's bits, no version bump
            res[check] = kept_engine_across(sync, model)
        if rank == 1:
            torch.save(res, out_path)
    finally:
        dist.destroy_process_group()


def test_broadcast_into_the_parameters_of_a_kept_engine(registered, tmp_path):
    import torch.multiprocessing as mp
    out = str(tmp_path / "rank1.pt")
    ctx = mp.start_processes(_broadcast_worker, args=(2, _free_port(), out), nprocs=2, join=False,
                             start_method="spawn")
    t0 = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - t0 > 480:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail("the 2 gloo workers did not finish within 480 s")
    res = torch.load(out)
    want = fresh_engine(tiny_model("llama", seed=0))  # rank 0's weights
    assert not same_runs(res["detector"][0], want)
    assert same_runs(res["detector"][1], want)
    assert not same_runs(res["old"][1], want)  # negative control: the old check misses the broadcast


def test_the_engine_hashes_at_admission_only_and_never_idle(registered, monkeypatch):
    """The cost the docs state: a full check (a hash of every weight) only on a step admitting requests, none on
    a decode step whose cheap check sees no change, none while a kept engine idles between generate calls (its
    loop polls every 0.1 s)."""
    from hal.weight_watch import ModelWeights
    stamps = []

    class Counting(ModelWeights):
        def stamp(self):
            stamps.append(1)
            return super().stamp()
    monkeypatch.setattr(hf_engine, "ModelWeights", Counting)
    model = tiny_model("llama")
    with lt.patch(model):
        try:
            _, steps, _ = run_engine(model, SHARED, CB, persistent=True)
            admitting = sum(1 for k, s in enumerate(steps)  # a request's first step: it was admitted there
                            if any(rid not in {r for t in steps[:k] for r, _, _ in t.requests} for rid, _, _ in s.requests))
            assert 0 < admitting < len(steps)  # decode steps happened, which must not hash
            assert len(stamps) == 1 + admitting  # + the stamp taken when the engine starts
            idle = len(stamps)
            time.sleep(1.0)
            assert len(stamps) == idle
        finally:
            model.destroy_cached_continuous_batching_manager()
