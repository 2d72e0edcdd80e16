"""When FP8 pays (issue 34): the estimate of tensorwise FP8's speedup of a training step from its linear layers'
GEMM shapes (precprof.analysis.fp8_speed), checked against the whole-step measurements it was fitted on, the
ones it must classify, and the other stacks' it is reported beside."""

from __future__ import annotations

import pytest

from precprof.analysis import fp8_speed as S
from precprof.analysis.advisor import AdvisorConfig
from precprof.analysis.advisor.decide import _fp8_why_not
from precprof.analysis.advisor.evidence import _Plan

TOKENS = 8 * 1024  # batch 8 x 1024, both models in bench/fp8_vs_bf16.py

# gpt2-small (n_embd 768, 12 layers): c_attn 768 -> 2304, attn.c_proj 768 -> 768, mlp.c_fc 768 -> 3072,
# mlp.c_proj 3072 -> 768; its output head 768 -> 50257 is tied to the token embedding and stays in bf16
GPT2_SMALL = [(TOKENS, 768, 2304), (TOKENS, 768, 768), (TOKENS, 768, 3072), (TOKENS, 3072, 768)] * 12
GPT2_HEAD = [(TOKENS, 768, 50257)]
# qwen2-2048 (hidden 2048, intermediate 8192, 16 heads, 16 key-value heads: head_dim 2048 / 16 = 128, so k and
# v are 16 x 128 = 2048 wide; 4 layers): q, k, v, o 2048 -> 2048, gate and up 2048 -> 8192, down 8192 -> 2048;
# the untied head 2048 -> 32768 (vocab_size), which the bench's fp8 run converted too (29 Float8Linear)
QWEN2_2048 = [(TOKENS, 2048, 2048)] * 4 * 4 + [(TOKENS, 2048, 8192)] * 2 * 4 + [(TOKENS, 8192, 2048)] * 4
QWEN2_HEAD = [(TOKENS, 2048, 32768)]


def test_on_an_h200_fp8_does_not_pay_for_gpt2_small_and_pays_for_qwen2_4096_qwen2_2048_missed() -> None:
    """bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27*.json: bf16 54.4 ms against fp8 72.3 ms a step for
    gpt2-small (0.75x), 44.4 against 51.7 ms for qwen2-2048 (0.86x), 112.2 against 89.5 ms for qwen2 with
    Llama3-8B's block shapes (1.25x). The two-constant estimate of before said 0.75x, 0.86x (fitted on them) and
    1.01x for the third: "not FP8" where FP8 paid. From the layers' GPU times (graph replays) gpt2-small stays
    under 1 but errs by 0.2 towards FP8, and qwen2-2048 is a KNOWN MISS, asserted as it stands: estimated 1.12x,
    above the threshold, where FP8 ran slower (test_the_fit_is_one_constant_over_three_steps...)."""
    gpt2 = S.estimate(GPT2_SMALL, GPT2_HEAD)
    qwen2 = S.estimate(QWEN2_2048 + QWEN2_HEAD)
    big = S.estimate(S.QWEN2_4096)
    assert gpt2 is not None and qwen2 is not None and big is not None
    cut = AdvisorConfig().fp8_speedup_min
    assert gpt2.speedup < 1 and big.speedup > cut
    assert gpt2.speedup == pytest.approx(0.955, abs=0.005)  # measured 0.75x: 0.2 towards FP8
    assert (
        qwen2.speedup == pytest.approx(1.122, abs=0.005) and qwen2.speedup > cut
    )  # measured 0.86x: the miss
    assert big.speedup == pytest.approx(112.22 / 89.48, abs=0.05)
    # the head left in bf16 instead (the 28 layers of the blocks alone): less than with it converted
    kept = S.estimate(QWEN2_2048, QWEN2_HEAD)
    assert kept is not None and kept.speedup < qwen2.speedup and kept.others == 1
    assert (gpt2.layers, gpt2.others, qwen2.layers, qwen2.others, big.layers) == (48, 1, 29, 0, 29)
    for est in (gpt2, qwen2, big):
        assert est.timed == est.layers  # every shape of these models was timed
        # the rest of the step dilutes the layers' gain or loss
        assert min(1.0, est.layers_speedup) < est.speedup < max(1.0, est.layers_speedup)


def test_and_the_verdict_says_the_speed_decided() -> None:
    """gpt2-small's verdict: the speed rules FP8 out, where the numbers allowed it (48 of 48 layers eligible);
    qwen2-4096's is FP8. qwen2-2048's is FP8 too, the known miss (it ran at 0.86x)."""
    for shapes, others, n in ((GPT2_SMALL, GPT2_HEAD, 48),):
        plan = _Plan(
            fp8_eligible=[f"l{i}" for i in range(n)],
            fp8_checked=n + len(others),
            fp8_flops_share=1.0 if not others else 0.69,
            fp8_speed=S.estimate(shapes, others),
        )
        why = _fp8_why_not(plan, AdvisorConfig())
        assert why.startswith("the speed decided: what FP8 does to the numbers allows it"), why
        assert "its casts and extra kernels cost more than its faster matmuls save" in why
    plan = _Plan(fp8_eligible=[f"l{i}" for i in range(29)], fp8_checked=29, fp8_flops_share=1.0)
    plan.fp8_speed = S.estimate(S.QWEN2_4096)
    assert _fp8_why_not(plan, AdvisorConfig()) == ""
    plan.fp8_speed = S.estimate(QWEN2_2048 + QWEN2_HEAD)
    assert _fp8_why_not(plan, AdvisorConfig()) == ""  # the known miss: FP8 advised, and it ran slower


def test_layer_times_are_the_table_and_interpolate_between_its_shapes() -> None:
    """A timed shape reads its row (scaled by tokens); another takes the time per M K N of its nearest timed
    shapes, so it lies between them; FP8's gain grows with the GEMMs."""
    b, f = S.layer_times(S.TABLE_TOKENS, 4096, 14336)
    assert (b, f) == pytest.approx((4317e-6, 2853e-6))
    b2, f2 = S.layer_times(S.TABLE_TOKENS // 2, 4096, 14336)
    assert (b2, f2) == pytest.approx((b / 2, f / 2))
    # 4096 x 12288 lies between 4096 x 4096 and 4096 x 14336 (and 4096 x 16384): its time per M K N too
    b3, f3 = S.layer_times(S.TABLE_TOKENS, 4096, 12288)
    per = [S.LAYER_TIMES[kn][0] / (kn[0] * kn[1]) for kn in ((4096, 4096), (4096, 14336), (4096, 16384))]
    assert min(per) * 0.99 < b3 / 1e-6 / (4096 * 12288) < max(per) * 1.01
    assert 1.4 < b3 / f3 < 1.6
    widths = (768, 2048, 4096, 8192)
    layers = [S.layer_speedup(TOKENS, w, 4 * w) for w in widths]
    assert layers == sorted(layers) and layers[0] < 1 < layers[-1]
    lo, hi = S.TABLE_SPEEDUPS
    assert lo == pytest.approx(63 / 95) and hi == pytest.approx(10178 / 6297)
    assert len(S.LAYER_TIMES) == 28 and S.LAYER_TIMES[(2048, 2048)] == (286, 277)
    small = S.estimate([(128, 96, 384)])
    assert small is not None and small.beyond == "below" and small.speedup < 1 and small.timed == 0
    assert S.estimate([]) is None and S.estimate([(0, 768, 768)]) is None
    assert S.intensity(1024, 2048, 1024) == pytest.approx(
        1024 * 2048 * 1024 / (1024 * 2048 * 2 + 1024 * 1024)
    )


def test_the_fit_is_one_constant_over_three_steps_and_leaves_their_residuals() -> None:
    """rest: 15.9 ps an element. gpt2-small 0.96x (measured 0.75x), qwen2-2048 1.12x (0.86x), qwen2-4096 1.25x
    (1.25x). KNOWN MISS, asserted as it stands: qwen2-2048 falls on the wrong side of 1 and of the threshold
    (its layers' GPU times save 5.8 ms of 24.2, its FP8 step took 7.3 ms more); gpt2-small stays on its side but
    errs by 0.2 towards FP8. Both steps' layers are small: what FP8 costs them beyond the GPU time of their
    layers (the host's launches, most likely) the model has no term for."""
    cut = AdvisorConfig().fp8_speedup_min
    fitted = [m for m in S.MEASURED if m.role == "fit"]
    assert len(fitted) == 3 and S.CONSTANTS.fitted_on == tuple(m.name for m in fitted)
    assert S.CONSTANTS.device == "NVIDIA H200"
    assert S.CONSTANTS.rest == pytest.approx(15.9e-12, abs=0.05e-12)  # seconds per element in and out
    got = {}
    for m in fitted:
        est = S.estimate(m.shapes, m.others)
        assert est is not None and est.timed == est.layers
        got[m.name.split(",")[0]] = round(est.speedup, 2)
        if m.miss:
            assert est.speedup > cut and m.speedup < 1, (m.name, est.speedup, m.speedup)
            assert f"estimated {est.speedup:.2f}x" in m.miss and f"measured {m.speedup:.2f}x" in m.miss
        else:
            assert (est.speedup > 1) == (m.speedup > 1) and (est.speedup > cut) == (m.speedup > cut)
    assert got == {"gpt2-small": 0.96, "qwen2-2048": 1.12, "qwen2-4096": 1.25}
    assert [m.name.split(",")[0] for m in S.MEASURED if m.miss] == ["qwen2-2048"]


def test_checks_and_references_fall_on_their_side_of_the_threshold() -> None:
    """gpt2-small measured without precprof on 2026-11-26 (24.4 ms against 32.6 ms, 0.75x): not fitted on,
    estimated 0.96x, on its side but 0.21 towards FP8 (its small layers' steps may be host-bound, which the
    layers' GPU times do not show). qwen2-3072 (bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27c.json, 1.19x):
    out of sample it missed at 1.06x and 1.09x (the call-by-call table, interpolated); with its five shapes
    timed as graphs it is estimated at 1.17x, an ordinary check. Other stacks: Llama3-8B on 8 H100s with
    torchtitan (1.25x) and torchao's single-layer H100 microbenchmarks (0.80x, 1.39x), whose layers are compared
    with the layers' estimate (on their side of 1 only: at 1,024 and 4,096 tokens they lie outside the table's
    8,192)."""
    cut = AdvisorConfig().fp8_speedup_min
    others = [m for m in S.MEASURED if m.role in ("check", "reference")]
    assert len(others) == 5 and not any(m.miss for m in others)
    got = {}
    for m in others:
        est = S.estimate(m.shapes, m.others)
        assert est is not None
        value = est.speedup if m.scope == "step" else est.layers_speedup
        got[m.name] = round(value, 2)
        assert (value > 1) == (m.speedup > 1), (m.name, value, m.speedup)
        if m.scope == "step":
            assert (value > cut) == (m.speedup > cut), (m.name, value, m.speedup)
    (q,) = [m for m in others if m.name.startswith("qwen2-3072")]
    assert q.role == "check" and q.shapes == S.QWEN2_3072 and len(q.shapes) == 29 and not q.others
    assert q.speedup == pytest.approx(61.93 / 51.84, abs=1e-3) and q.bf16_s == pytest.approx(
        0.06193, abs=1e-5
    )
    assert "fp8_vs_bf16_nvidia-h200_2026-11-27c.json" in q.source and q.cite in q.source
    est = S.estimate(q.shapes)
    assert est is not None and est.timed == 29  # every shape timed now: no longer out of sample
    assert got[q.name] == 1.17 and abs(est.speedup - q.speedup) < 0.05
    assert got["gpt2-small without precprof"] == 0.96  # measured 0.75x
    assert got["Llama3-8B, torchtitan"] == 1.22  # measured 1.25x


def test_the_interpolation_is_chosen_by_leave_one_out() -> None:
    """Each timed shape predicted from the other 27 (``leave_one_out``): the count of neighbours, 1 to 8, is
    the one whose error of a layer's FP8 speedup is least, judged on the table alone (not on the checks). Four:
    7.0% RMS, six 7.04% nearly as good, two 8.1%, one 9.4%. With the call-by-call table it was two (18%) and
    four (20%): its launch floors, not the interpolation, erred."""
    runs = {n: S.leave_one_out(n) for n in range(1, 9)}
    best = min(runs, key=lambda n: runs[n].speedup)
    assert S._NEAREST == best == 4
    four, six, two, one = runs[4], runs[6], runs[2], runs[1]
    assert four.speedup == pytest.approx(0.0701, abs=0.0002) and six.speedup == pytest.approx(
        0.0704, abs=0.0002
    )
    assert two.speedup == pytest.approx(0.0806, abs=0.0002) and one.speedup == pytest.approx(
        0.0937, abs=0.0002
    )
    assert four.interior == pytest.approx(0.0683, abs=0.0002) and two.interior == pytest.approx(
        0.0841, abs=0.0002
    )
    assert four.bf16 == pytest.approx(0.0670, abs=0.0002) and four.fp8 == pytest.approx(0.1121, abs=0.0002)
    assert four.worst[:2] == (1024, 16384) and four.worst[2] == pytest.approx(0.229, abs=0.002)
    # the method itself: a table whose time per M K N is one constant per format is interpolated exactly
    exact = {(k, n): (2e-6 * k * n, 1.5e-6 * k * n) for k in (512, 1024, 4096) for n in (768, 2048, 8192)}
    for n in (1, 2, 4):
        e = S.leave_one_out(n, exact)
        assert max(e.bf16, e.fp8, e.speedup, e.interior) < 1e-9 and e.nearest == n


def test_the_estimate_explains_itself_and_says_where_its_numbers_come_from() -> None:
    est = S.estimate(GPT2_SMALL, GPT2_HEAD)
    assert est is not None
    text = est.explain()
    for part in ("48 converted linear layers", "0.80x", "all at shapes timed", "0.66x to 1.62x", "0.96x"):
        assert part in text, (part, text)
    assert "the 1 linear layer left in bf16" in text
    mixed = S.estimate([(TOKENS, 4096, 4096), (TOKENS, 4096, 12288)])
    assert mixed is not None and "1 at shapes timed, the others interpolated" in mixed.explain()
    alone = S.estimate([(TOKENS, 4096, 12288)])
    assert alone is not None and "none at a shape timed: each interpolated" in alone.explain()
    assert "CUDA graph replays, the GPU's time without the host's launches" in text
    # the known miss is said with every estimate: it errs towards FP8 wherever the host costs FP8 more
    for e in (est, mixed, alone):
        assert "misled the estimate towards FP8 (qwen2-2048 ran at 0.86x, estimated 1.12x)" in e.explain()
    sources = S.sources()
    for m in S.MEASURED:
        assert m.source and m.cite and m.name in sources and m.device in sources and m.cite in sources
    for f in ("fp8_vs_bf16_nvidia-h200_2026-11-27.json", "fp8_vs_bf16_nvidia-h200_2026-11-27b.json"):
        assert f in sources
    assert (
        "a step 1.19x, estimated 1.17x; checked; bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27c" in sources
    )
    assert "a step 0.86x, estimated 1.12x; fitted, a known miss;" in sources
    assert "fp8_layers_nvidia-h200_2026-11-27c.json (28 shapes" in sources and "CUDA graph replays" in sources


def test_the_recorded_gpu_runs_would_now_be_judged_right_but_qwen2_2048() -> None:
    """bench/fp8_vs_bf16.py's runs on an H200 (bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27*.json): bf16
    against fp8 training, both compiled, with the advisor's verdict of the time. Two verdicts were wrong there
    (qwen2-2048 advised FP8 and ran slower; qwen2-4096 not advised and ran 1.25x faster with matching losses).
    Where the numbers allowed FP8 (the recorded profile's verdict was decided by the speed, or was FP8), the
    verdict now follows today's estimate. KNOWN MISS, asserted as it stands: from the layers' GPU times
    qwen2-2048 is advised FP8 again (estimated 1.12x; it ran at 0.86x)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    shapes = {
        "gpt2-small": (S.GPT2_SMALL, S.GPT2_SMALL_HEAD),
        "qwen2-2048": (S.QWEN2_2048 + S.QWEN2_2048_HEAD, ()),
        "qwen2-4096": (S.QWEN2_4096, ()),
    }
    cut = AdvisorConfig().fp8_speedup_min
    seen = {}
    for name in ("fp8_vs_bf16_nvidia-h200_2026-11-27.json", "fp8_vs_bf16_nvidia-h200_2026-11-27b.json"):
        for model, rec in json.loads((results / name).read_text())["models"].items():
            profile, outcome = rec["profile"], rec["outcome"]
            assert profile["not_fp8_decided_by"] in ("speed", None)  # the numbers allowed FP8 in all three
            assert profile["fp8_eligible"] == len(shapes[model][0])
            est = S.estimate(*shapes[model])
            assert est is not None
            seen[model] = (est.speedup > cut, outcome["fp8_pays"], outcome["verdict_right"])
    assert seen == {
        "gpt2-small": (False, False, True),
        "qwen2-2048": (True, False, False),
        "qwen2-4096": (True, True, False),
    }


def test_each_step_left_out_of_the_fit_is_judged_as_within_it() -> None:
    """Leave-one-out: the rest's constant fitted on the other two steps, gpt2-small comes out at 0.95x (0.75x),
    qwen2-2048 at 1.10x (0.86x) and qwen2-4096 at 1.24x (1.25x): the layer table, not the fit, carries the
    verdicts, qwen2-2048's known miss (above the threshold, 1.102x) included."""
    cut = AdvisorConfig().fp8_speedup_min
    fitted = [m for m in S.MEASURED if m.role == "fit"]
    got = {}
    for out in fitted:
        constants = S.fit([m for m in fitted if m is not out])
        assert out.name not in constants.fitted_on
        est = S.estimate(out.shapes, out.others, constants=constants)
        assert est is not None
        got[out.name.split(",")[0]] = round(est.speedup, 3)
        if out.miss:
            assert est.speedup > cut and out.speedup < 1
        else:
            assert (est.speedup > 1) == (out.speedup > 1) and (est.speedup > cut) == (out.speedup > cut)
    assert got == pytest.approx({"gpt2-small": 0.945, "qwen2-2048": 1.102, "qwen2-4096": 1.244}, abs=0.001)
