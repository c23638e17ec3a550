"""hal.rl: metrics, corrections and the DLC decomposition against hand-computed values."""
import math

import numpy as np
import pytest
import torch

import hal
from hal import rl

# two sequences of three tokens; the last token of sequence 1 is padding (mask 0)
P = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]], dtype=torch.float64)
Q = torch.tensor([[-1.0, -2.5, -0.25], [-0.1, -2.0, -1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
LR = [0.0, 0.5, -0.25, 0.0, -1.0]  # log p - log q of the counted tokens, in order


def test_kl_estimators_match_hand_computation():
    kl = rl.kl_estimators(P, Q, MASK)
    assert kl["k1"] == pytest.approx(sum(-x for x in LR) / 5, rel=1e-15)
    assert kl["k2"] == pytest.approx(sum(x * x / 2 for x in LR) / 5, rel=1e-15)
    assert kl["k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in LR) / 5, rel=1e-15)


def test_effective_sample_size_hand_values():
    assert rl.effective_sample_size(torch.zeros(7)) == pytest.approx(7.0)
    w = [1.0, 2.0, 4.0]
    assert rl.effective_sample_size(torch.log(torch.tensor(w))) == pytest.approx(sum(w) ** 2 / sum(x * x for x in w))
    # shift-invariant and overflow-free
    assert rl.effective_sample_size(torch.tensor([1000.0, 1000.0])) == pytest.approx(2.0)


def test_mismatch_metrics_batched_and_packed_agree_with_hand_values():
    m = rl.mismatch_metrics(P, Q, MASK)
    assert m.tokens == 5 and m.sequences == 2
    assert m.max_abs_log_ratio == 1.0 and m.mean_abs_log_ratio == pytest.approx(1.75 / 5)
    assert m.share_bits_differ == pytest.approx(3 / 5)  # tokens 0 and 3 are bit-identical
    seq_w = [math.exp(0.25), math.exp(-1.0)]
    assert m.ess_sequences == pytest.approx(sum(seq_w) ** 2 / sum(x * x for x in seq_w))
    w0 = [1.0, math.exp(0.5), math.exp(-0.25)]
    assert m.ess_per_sequence[0] == pytest.approx(sum(w0) ** 2 / sum(x * x for x in w0) / 3)
    packed = rl.mismatch_metrics(P[MASK], Q[MASK], cu_seqlens=torch.tensor([0, 3, 5]))
    for field in ("tokens", "max_abs_log_ratio", "k1", "k3", "ess_sequences", "share_bits_differ"):
        assert getattr(packed, field) == pytest.approx(getattr(m, field)), field


def test_identical_logprobs_report_exact_zero_and_full_ess():
    p = torch.randn(4, 9, dtype=torch.float32)
    m = rl.mismatch_metrics(p, p.clone())
    assert m.share_bits_differ == 0.0 and m.max_abs_log_ratio == 0.0 and m.k1 == 0.0 and m.k3 == 0.0
    assert m.ess_sequences == pytest.approx(4.0) and m.ess_tokens == pytest.approx(36.0)


def test_share_bits_differ_sees_signed_zero():
    a = torch.tensor([[0.0, -1.0]])
    b = torch.tensor([[-0.0, -1.0]])
    assert rl.mismatch_metrics(a, b).share_bits_differ == 0.5  # a tolerance-based check would say 0


def test_ratio_histogram_central_bin_counts_exact_matches():
    edges, counts, nonfinite = rl.ratio_histogram(P, Q, MASK)
    assert int(counts.sum()) == 5 and nonfinite == 0
    central = int(torch.bucketize(torch.tensor([1.0], dtype=torch.float64), edges, right=True)[0]) - 1
    assert int(counts[central]) == 2  # the two tokens with log r = 0


def test_truncated_and_masked_importance_weights():
    w = rl.truncated_is_weights(P, Q, cap=1.5, mask=MASK)
    want = torch.tensor([[1.0, 1.5, math.exp(-0.25)], [1.0, math.exp(-1.0), 0.0]], dtype=torch.float64)
    assert torch.allclose(w, want, rtol=1e-15, atol=0)
    tok = rl.masked_is_weights(P, Q, low=0.5, high=1.5, mask=MASK)
    want_tok = torch.tensor([[1.0, 0.0, math.exp(-0.25)], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(tok, want_tok, rtol=1e-15, atol=0)
    # sequence level: geometric means exp(0.25 / 3) (kept) and exp(-1 / 2) ~ 0.61 (kept at low=0.5, dropped at 0.7)
    seq = rl.masked_is_weights(P, Q, low=0.7, high=1.5, level="sequence", mask=MASK)
    assert float(seq[1].abs().sum()) == 0.0 and float(seq[0, 1]) == pytest.approx(math.exp(0.5))
    with pytest.raises(hal.InputError):
        rl.masked_is_weights(P, Q, low=2.0, high=3.0)
    with pytest.raises(hal.InputError):
        rl.truncated_is_weights(P, Q, cap=0)


def test_score_centering_gradient_is_score_minus_expected_score():
    logits = torch.tensor([0.3, -1.2, 2.0, 0.1], dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    qv = torch.tensor([0.5, 0.1, 0.3, 0.1], dtype=torch.float64)
    surrogate = rl.score_centered_logprobs(logp[2], logp, qv)
    (g,) = torch.autograd.grad(surrogate, logits)
    p = torch.softmax(logits.detach(), -1)
    score = lambda v: torch.nn.functional.one_hot(torch.tensor(v), 4).double() - p  # noqa: E731
    want = score(2) - sum(qv[v] * score(v) for v in range(4))
    assert torch.allclose(g, want, rtol=1e-12, atol=1e-15)


def test_dlc_decomposition_is_exact_and_flags_resync():
    p_old = Q + torch.tensor([[0.0, 0.01, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    d = rl.dlc_decompose(P, p_old, Q, MASK)
    delta = torch.where(MASK, P - Q, 0.0)
    assert torch.equal(d.lag + d.mismatch, delta)
    assert d.mismatch_mean == pytest.approx(0.01 / 5)
    assert float(d.mismatch_centered[MASK].sum()) == pytest.approx(0.0, abs=1e-17)
    # lag weights exp(0.24), exp(-1): ESS ~ 1.74 of 2 -> no resync at 0.5, resync at 0.9
    assert not d.resync
    assert rl.dlc_decompose(P, p_old, Q, MASK, resync_threshold=0.9).resync
    # no lag, no mismatch: on-policy, ESS = batch
    z = rl.dlc_decompose(Q, Q, Q, MASK)
    assert z.max_abs_mismatch == 0.0 and z.ess_lag_sequences == pytest.approx(2.0) and not z.resync


def test_dlc_token_weights_clip_like_ppo():
    lag = torch.log(torch.tensor([1.1, 1.3, 0.7, 0.9, 5.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    w = rl.dlc_token_weights(lag, adv, eps=0.2, dual_clip=3.0)
    assert torch.allclose(w, torch.tensor([1.1, 0.0, 0.0, 0.9, 3.0], dtype=torch.float64), rtol=1e-6)


def test_bad_inputs_are_named():
    with pytest.raises(hal.InputError, match="shape"):
        rl.mismatch_metrics(P, Q[:, :2])
    with pytest.raises(hal.InputError, match="cu_seqlens"):
        rl.mismatch_metrics(P[MASK], Q[MASK], cu_seqlens=torch.tensor([0, 3, 4]))
    with pytest.raises(hal.InputError, match="floating"):
        rl.mismatch_metrics(P.long(), Q)


def test_cli_report_prints_metrics_for_saved_arrays(tmp_path, capsys):
    from hal.cli import main
    path = tmp_path / "lp.npz"
    np.savez(path, trainer=P.numpy(), sampler=Q.numpy(), mask=MASK.numpy())
    assert main(["rl", "report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tokens" in out and "60.0 %" in out and "ESS sequences" in out
    np.savez(path, trainer=P.numpy())
    assert main(["rl", "report", str(path)]) == 2
    npy = tmp_path / "lp.npy"  # a single array, not an archive: a clear error, not a traceback
    np.save(npy, P.numpy())
    assert main(["rl", "report", str(npy)]) == 2
    assert "not an .npz archive" in capsys.readouterr().err


# ---- edge cases (issue 21 item 13): each metric's defined value, compared exactly

INF = float("inf")


def test_fully_masked_rows_are_not_sequences():
    # two sequences with weights exp(0.25), exp(-1), plus two rows with no counted token
    p = torch.cat([P, torch.zeros(2, 3, dtype=torch.float64)])
    q = torch.cat([Q, torch.zeros(2, 3, dtype=torch.float64)])
    mask = torch.cat([MASK, torch.zeros(2, 3, dtype=torch.bool)])
    base, padded = rl.mismatch_metrics(P, Q, MASK), rl.mismatch_metrics(p, q, mask)
    assert padded.sequences == 2 and padded.ess_sequences == base.ess_sequences
    assert padded.ess_per_sequence == base.ess_per_sequence + [None, None]
    # packed, with empty cu_seqlens segments: the same
    packed = rl.mismatch_metrics(P[MASK], Q[MASK], cu_seqlens=torch.tensor([0, 0, 3, 3, 5]))
    assert packed.sequences == 2 and packed.ess_sequences == base.ess_sequences
    assert packed.ess_per_sequence == [None, base.ess_per_sequence[0], None, base.ess_per_sequence[1]]
    # DLC: lag weights exp(0.24), exp(-1), ESS ~1.74 of 2: no resync; the empty rows must not flip it
    p_old = Q + torch.tensor([[0.0, 0.01, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    d_base = rl.dlc_decompose(P, p_old, Q, MASK)
    d = rl.dlc_decompose(p, torch.cat([p_old, torch.zeros(2, 3, dtype=torch.float64)]), q, mask)
    assert d.sequences == 2 and d.ess_lag_sequences == d_base.ess_lag_sequences and not d.resync


def test_effective_sample_size_edge_cases():
    assert rl.effective_sample_size(torch.full((3,), -INF)) == 0.0  # every weight 0
    assert rl.effective_sample_size(torch.tensor([0.0, INF, -1.0])) == 1.0  # one +inf weight dominates
    assert rl.effective_sample_size(torch.tensor([INF, 0.0, INF])) == 2.0
    assert rl.effective_sample_size(torch.tensor([-INF, 0.0, 0.0])) == 2.0  # zero weights add nothing
    assert rl.effective_sample_size(torch.tensor([])) == 0.0
    assert math.isnan(rl.effective_sample_size(torch.tensor([0.0, float("nan")])))


def test_identical_minus_inf_is_no_difference():
    # token 2 of row 0: both engines give -inf (probability 0): log r = 0, not NaN
    p = torch.tensor([[-1.0, -2.0, -INF]], dtype=torch.float32)
    q = torch.tensor([[-1.0, -2.5, -INF]], dtype=torch.float32)
    m = rl.mismatch_metrics(p, q)
    lr = [0.0, 0.5, 0.0]
    assert m.share_bits_differ == 1 / 3
    assert m.max_abs_log_ratio == 0.5 and m.mean_abs_log_ratio == 0.5 / 3
    assert m.k1 == float(torch.tensor([-x for x in lr], dtype=torch.float64).mean())
    assert m.k3 == float(torch.tensor([math.expm1(x) - x for x in lr], dtype=torch.float64).mean())
    w = torch.exp(torch.tensor(lr, dtype=torch.float64) - 0.5)
    assert m.ess_tokens == float(w.sum() ** 2 / (w * w).sum())
    assert m.ess_sequences == 1.0 and m.ess_per_sequence == [m.ess_tokens / 3]
    same = rl.mismatch_metrics(p, p.clone())
    assert same.share_bits_differ == 0.0 and same.k1 == same.k2 == same.k3 == 0.0 and same.ess_tokens == 3.0
    edges, counts, nonfinite = rl.ratio_histogram(p, p.clone())
    assert nonfinite == 0 and int(counts[5]) == 3  # all three in the central bin [1 - 1e-6, 1 + 1e-6)
    assert float(edges[5]) == 1 - 1e-6
    w = rl.truncated_is_weights(p, p.clone(), cap=2.0)
    assert torch.equal(w, torch.ones(1, 3))


def test_sampler_minus_inf_against_finite_trainer():
    p = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    q = torch.tensor([[-1.0, -INF]], dtype=torch.float64)  # log r = +inf on token 1
    kl = rl.kl_estimators(p, q)
    assert kl == {"k1": -INF, "k2": INF, "k3": INF}
    kl_rev = rl.kl_estimators(q, p)  # trainer -inf, sampler finite: log r = -inf
    assert kl_rev == {"k1": INF, "k2": INF, "k3": INF}
    m = rl.mismatch_metrics(p, q)
    assert m.ess_tokens == 1.0 and m.ess_sequences == 1.0 and m.max_abs_log_ratio == INF


def test_ratio_histogram_counts_non_finite_ratios_apart():
    p = torch.tensor([[-1.0, -2.0, float("nan"), -1.0]], dtype=torch.float64)
    q = torch.tensor([[-1.0, -INF, -1.0, -1.5]], dtype=torch.float64)  # r = 1, +inf, NaN, exp(0.5)
    edges, counts, nonfinite = rl.ratio_histogram(p, q)
    assert nonfinite == 2 and int(counts.sum()) == 2
    want = torch.zeros(edges.numel() - 1, dtype=torch.int64)
    want[5] = 1   # r = 1: [1 - 1e-6, 1 + 1e-6)
    want[10] = 1  # r = exp(0.5) = 1.65: [1.5, inf)
    assert torch.equal(counts, want)


def test_to_json_is_strict_json_with_non_finite_as_strings():
    import json
    p = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    q = torch.tensor([[-1.0, -INF]], dtype=torch.float64)
    m = rl.mismatch_metrics(p, q)
    text = m.to_json()
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert back["k1"] == "-inf" and back["k3"] == "inf" and back["max_abs_log_ratio"] == "inf"
    assert float(back["k1"]) == m.k1 and back["tokens"] == 2
    padded = rl.mismatch_metrics(torch.zeros(2, 2), torch.zeros(2, 2), mask=torch.tensor([[1, 1], [0, 0]]))
    assert json.loads(padded.to_json())["ess_per_sequence"] == [1.0, None]


def test_parameters_and_layout_inputs_are_checked():
    with pytest.raises(hal.InputError, match="cap must be a real number"):
        rl.truncated_is_weights(P, Q, cap="2")
    with pytest.raises(hal.InputError, match="cap must be a non-NaN"):
        rl.truncated_is_weights(P, Q, cap=float("nan"))
    assert torch.equal(rl.truncated_is_weights(P, Q, cap=INF), torch.exp(P - Q))  # inf: no cap
    with pytest.raises(hal.InputError, match="low must be a real number"):
        rl.masked_is_weights(P, Q, low="0.5")
    with pytest.raises(hal.InputError, match="eps must be a real number"):
        rl.dlc_token_weights(P - Q, torch.ones(2, 3), eps=None)
    with pytest.raises(hal.InputError, match="resync_threshold"):
        rl.dlc_decompose(P, P, Q, resync_threshold="0.5")
    # a float cu_seqlens would be truncated ([0, 2.9, 5] -> [0, 2, 5]): refused, naming the argument
    with pytest.raises(hal.InputError, match="cu_seqlens must be an integer tensor"):
        rl.mismatch_metrics(P[MASK], Q[MASK], cu_seqlens=torch.tensor([0.0, 2.9, 5.0]))
    # a mask value other than 0/1 would silently count as True
    with pytest.raises(hal.InputError, match="only 0 and 1, got the value 0.5"):
        rl.mismatch_metrics(P, Q, mask=torch.tensor([[1.0, 0.5, 1.0], [1.0, 1.0, 0.0]]))
    assert rl.mismatch_metrics(P, Q, mask=MASK.to(torch.float32)) == rl.mismatch_metrics(P, Q, mask=MASK)


def test_no_counted_token_at_all():
    m = rl.mismatch_metrics(P, Q, mask=torch.zeros(2, 3, dtype=torch.bool))
    assert (m.tokens, m.sequences, m.ess_per_sequence) == (0, 0, [None, None])
    assert (m.max_abs_log_ratio, m.mean_abs_log_ratio, m.share_bits_differ, m.k1, m.k2, m.k3,
            m.ess_tokens, m.ess_sequences) == (0.0,) * 8
    d = rl.dlc_decompose(P, P, Q, mask=torch.zeros(2, 3, dtype=torch.bool))
    assert d.sequences == 0 and d.ess_lag_sequences == 0.0 and not d.resync
