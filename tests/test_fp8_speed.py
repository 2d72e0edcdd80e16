"""When FP8 pays (issue 34): the estimate of tensorwise FP8's speedup of a training step from its linear layers'
GEMM shapes (precprof.analysis.fp8_speed), checked against the whole-step measurements it was fitted on, the
ones it must classify, and the other stacks' it is reported beside."""

from __future__ import annotations

from collections.abc import Sequence

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


def test_on_an_h200_fp8_does_not_pay_for_gpt2_small_or_qwen2_2048_and_pays_for_qwen2_4096() -> None:
    """bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27*.json: bf16 54.4 ms against fp8 72.3 ms a step for
    gpt2-small (0.75x), 44.4 against 51.7 ms for qwen2-2048 (0.86x), 112.2 against 89.5 ms for qwen2 with
    Llama3-8B's block shapes (1.25x). The two-constant estimate of before said 0.75x, 0.86x (fitted on them) and
    1.01x for the third; the graph table alone said 1.12x for qwen2-2048 (FP8, where it ran slower). The bracket:
    gpt2-small 0.72x to 0.96x (measured 0.75x: inside), qwen2-2048 0.92x to 1.12x (0.86x: below it, the verdict
    bf16 right), qwen2-4096 1.240x to 1.251x (1.254x: just above it, the verdict FP8 right)."""
    gpt2 = S.estimate(GPT2_SMALL, GPT2_HEAD)
    qwen2 = S.estimate(QWEN2_2048 + QWEN2_HEAD)
    big = S.estimate(S.QWEN2_4096)
    assert gpt2 is not None and qwen2 is not None and big is not None
    cut = AdvisorConfig().fp8_speedup_min
    assert gpt2.speedup_gpu_bound < 1 and qwen2.speedup < 1 < cut < big.speedup
    assert (gpt2.speedup_launch_bound, gpt2.speedup_gpu_bound) == pytest.approx((0.716, 0.955), abs=0.001)
    assert (qwen2.speedup_launch_bound, qwen2.speedup_gpu_bound) == pytest.approx((0.917, 1.122), abs=0.001)
    assert (big.speedup_launch_bound, big.speedup_gpu_bound) == pytest.approx((1.240, 1.251), abs=0.001)
    for est in (gpt2, qwen2, big):  # the conservative end is the host-bound one on all three
        assert est.speedup == est.speedup_launch_bound < est.speedup_gpu_bound
        assert (est.layers_speedup, est.gemm_share) == (est.layers_launch_bound, est.gemm_share_launch_bound)
    # the head left in bf16 instead (the 28 layers of the blocks alone): less than with it converted
    kept = S.estimate(QWEN2_2048, QWEN2_HEAD)
    assert kept is not None and kept.others == 1
    assert (
        kept.speedup_launch_bound < qwen2.speedup_launch_bound
        and kept.speedup_gpu_bound < qwen2.speedup_gpu_bound
    )
    assert (gpt2.layers, gpt2.others, qwen2.layers, qwen2.others, big.layers) == (48, 1, 29, 0, 29)
    for est in (gpt2, qwen2, big):
        assert est.timed == est.layers  # every shape of these models was timed
        # the rest of the step dilutes the layers' gain or loss, at each end
        for step, layers in (
            (est.speedup_launch_bound, est.layers_launch_bound),
            (est.speedup_gpu_bound, est.layers_gpu_bound),
        ):
            assert min(1.0, layers) < step < max(1.0, layers)


def _plan(
    shapes: Sequence[S.Shape], others: Sequence[S.Shape] = (), n: int = 29, share: float = 1.0
) -> _Plan:
    return _Plan(
        fp8_eligible=[f"l{i}" for i in range(n)],
        fp8_checked=n + len(others),
        fp8_flops_share=share,
        fp8_speed=S.estimate(shapes, others),
    )


def test_and_the_verdict_says_the_speed_decided_and_where_fp8_may_pay() -> None:
    """gpt2-small's verdict: the speed rules FP8 out, where the numbers allowed it (48 of 48 layers eligible),
    both ends under 1. qwen2-2048's: not FP8 (0.92x host-bound), but its GPU-bound end (1.12x) clears the
    threshold, and the reason says so: FP8 may pay on a GPU-bound step; measure it (it ran at 0.86x: its step is
    host-bound). qwen2-4096's and qwen2-3072's: FP8, both ends above 1.1x."""
    why = _fp8_why_not(_plan(GPT2_SMALL, GPT2_HEAD, 48, 0.69), AdvisorConfig())
    assert why.startswith("the speed decided: what FP8 does to the numbers allows it"), why
    assert (
        "an estimated 0.72x of bf16's speed with launches as timed call by call, 0.96x if the host keeps ahead of "
        "the GPU" in why
    )
    assert why.endswith(
        "neither above 1.1x: its casts and extra kernels cost more than its faster matmuls save"
    )
    assert _fp8_why_not(_plan(S.QWEN2_4096), AdvisorConfig()) == ""
    assert _fp8_why_not(_plan(S.QWEN2_3072), AdvisorConfig()) == ""
    why = _fp8_why_not(_plan(QWEN2_2048 + QWEN2_HEAD), AdvisorConfig())
    assert why.startswith("the speed decided"), why
    assert (
        "an estimated 0.92x of bf16's speed with launches as timed call by call, 1.12x if the host keeps ahead of "
        "the GPU" in why
    )
    assert why.endswith("only the latter above 1.1x: FP8 may pay on a GPU-bound step; measure it"), why
    # the head left in bf16: 0.89x to 1.09x, neither end above 1.1x but the GPU-bound one above 1
    why = _fp8_why_not(_plan(QWEN2_2048, QWEN2_HEAD, 28), AdvisorConfig())
    assert why.endswith("neither above 1.1x: too small a gain to promise one on another model or stack"), why


def test_layer_times_are_the_tables_and_interpolate_between_their_shapes() -> None:
    """Each table is the 2026-11-27c file's timings, one per row; a timed shape reads its row (scaled by tokens);
    another takes the time per M K N of its nearest timed shapes, so it lies between them; FP8's gain grows
    with the GEMMs in both tables."""
    import json
    from pathlib import Path

    path = (
        Path(__file__).resolve().parents[1] / "bench" / "results" / "fp8_layers_nvidia-h200_2026-11-27c.json"
    )
    data = json.loads(path.read_text())
    assert data["tokens"] == S.TABLE_TOKENS and data["device"] == S.TABLE_DEVICE
    for key, table in (("graph_s", S.LAYER_TIMES_GPU), ("eager_launch_s", S.LAYER_TIMES_LAUNCH)):
        assert table == {
            (r["k"], r["n"]): (round(r["bf16"][key] * 1e6), round(r["fp8"][key] * 1e6))
            for r in data["shapes"]
        }
        assert all(r["m"] == S.TABLE_TOKENS for r in data["shapes"])
    b, f = S.layer_times(S.TABLE_TOKENS, 4096, 14336, S.LAYER_TIMES_GPU)
    assert (b, f) == pytest.approx((4317e-6, 2853e-6))
    b2, f2 = S.layer_times(S.TABLE_TOKENS // 2, 4096, 14336, S.LAYER_TIMES_GPU)
    assert (b2, f2) == pytest.approx((b / 2, f / 2))
    assert S.layer_times(S.TABLE_TOKENS, 4096, 14336, S.LAYER_TIMES_LAUNCH) == pytest.approx(
        (4424e-6, 2972e-6)
    )
    # 4096 x 12288 lies between 4096 x 4096 and 4096 x 14336 (and 4096 x 16384): its time per M K N too
    for table in (S.LAYER_TIMES_GPU, S.LAYER_TIMES_LAUNCH):
        b3, f3 = S.layer_times(S.TABLE_TOKENS, 4096, 12288, table)
        per = [table[kn][0] / (kn[0] * kn[1]) for kn in ((4096, 4096), (4096, 14336), (4096, 16384))]
        assert min(per) * 0.99 < b3 / 1e-6 / (4096 * 12288) < max(per) * 1.01
        assert 1.4 < b3 / f3 < 1.6
        widths = (768, 2048, 4096, 8192)
        layers = [S.layer_speedup(TOKENS, w, 4 * w, table) for w in widths]
        assert layers == sorted(layers) and layers[0] < 1 < layers[-1]
    gpu, launch = S.TABLE_SPEEDUPS_GPU, S.TABLE_SPEEDUPS_LAUNCH
    assert gpu == pytest.approx((63 / 95, 10178 / 6297))
    assert launch == pytest.approx((557 / 1130, 10292 / 6594))
    assert len(S.LAYER_TIMES_GPU) == 28 and S.LAYER_TIMES_GPU[(2048, 2048)] == (286, 277)
    assert S.LAYER_TIMES_LAUNCH[(2048, 2048)] == (
        756,
        1094,
    )  # the host's rate: 0.69x call by call, 1.03x as graphs
    small = S.estimate([(128, 96, 384)])
    assert small is not None and small.beyond == "below" and small.speedup_gpu_bound < 1 and small.timed == 0
    assert S.estimate([]) is None and S.estimate([(0, 768, 768)]) is None
    assert S.intensity(1024, 2048, 1024) == pytest.approx(
        1024 * 2048 * 1024 / (1024 * 2048 * 2 + 1024 * 1024)
    )


def _ends(m: S.Measurement, constants: S.Constants = S.CONSTANTS) -> tuple[float, float, float]:
    est = S.estimate(m.shapes, m.others, constants=constants)
    assert est is not None
    return est.speedup_launch_bound, est.speedup_gpu_bound, est.speedup


def test_the_fit_is_one_constant_per_table_over_three_steps_and_leaves_their_residuals() -> None:
    """rest: 8.9 ps an element with the call-by-call table, 15.9 ps with the graphs. Every fit step's verdict
    (the lower end) falls on its measured side of 1 and of the threshold; the measured value lies inside the
    bracket for gpt2-small only: qwen2-2048's 0.86x is below its 0.92x to 1.12x (its FP8 step cost more than
    even its layers' launches timed alone show), qwen2-4096's 1.254x just above its 1.240x to 1.251x."""
    cut = AdvisorConfig().fp8_speedup_min
    fitted = [m for m in S.MEASURED if m.role == "fit"]
    assert len(fitted) == 3 and S.CONSTANTS.fitted_on == tuple(m.name for m in fitted)
    assert S.CONSTANTS.device == "NVIDIA H200"
    assert S.CONSTANTS.rest_launch_bound == pytest.approx(8.9e-12, abs=0.05e-12)  # seconds per element
    assert S.CONSTANTS.rest_gpu_bound == pytest.approx(15.9e-12, abs=0.05e-12)
    got = {}
    inside = {}
    for m in fitted:
        lo, hi, verdict = _ends(m)
        assert not m.miss
        assert (verdict > 1) == (m.speedup > 1) and (verdict > cut) == (m.speedup > cut), (m.name, verdict)
        got[m.name.split(",")[0]] = (round(lo, 3), round(hi, 3))
        inside[m.name.split(",")[0]] = (
            "inside"
            if min(lo, hi) <= m.speedup <= max(lo, hi)
            else ("below" if m.speedup < min(lo, hi) else "above")
        )
    assert got == {"gpt2-small": (0.716, 0.955), "qwen2-2048": (0.917, 1.122), "qwen2-4096": (1.240, 1.251)}
    assert inside == {"gpt2-small": "inside", "qwen2-2048": "below", "qwen2-4096": "above"}
    assert [m.name for m in S.MEASURED if m.miss] == []  # no known miss


def test_checks_and_references_fall_on_their_side_of_the_threshold() -> None:
    """gpt2-small measured without precprof on 2026-11-26 (24.4 ms against 32.6 ms, 0.75x): not fitted on,
    0.72x to 0.96x, the measured value inside. qwen2-3072 (bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27c.json,
    1.19x): 1.10x to 1.17x, the measured value above the bracket (its step is GPU-bound and gains a little more
    than its layers' graph times say); its verdict FP8 is right by a hair: the lower end 1.103x against 1.1x.
    Out of sample it had missed at 1.06x and 1.09x (the old call-by-call table, interpolated), then stood at
    1.17x (the graph table alone). Other stacks: Llama3-8B on 8 H100s with torchtitan (1.25x; 1.21x to 1.22x)
    and torchao's single-layer H100 microbenchmarks (0.80x, 1.39x), whose layers are compared with the layers'
    estimate at both ends (on their side of 1 only: at 1,024 and 4,096 tokens they lie outside the table's
    8,192)."""
    cut = AdvisorConfig().fp8_speedup_min
    others = [m for m in S.MEASURED if m.role in ("check", "reference")]
    assert len(others) == 5 and not any(m.miss for m in others)
    got = {}
    for m in others:
        est = S.estimate(m.shapes, m.others)
        assert est is not None
        if m.scope == "step":
            lo, hi = est.speedup_launch_bound, est.speedup_gpu_bound
            assert (est.speedup > 1) == (m.speedup > 1), (m.name, est.speedup, m.speedup)
            assert (est.speedup > cut) == (m.speedup > cut), (m.name, est.speedup, m.speedup)
        else:
            lo, hi = est.layers_launch_bound, est.layers_gpu_bound
            assert (lo > 1) == (hi > 1) == (m.speedup > 1), (m.name, lo, hi, m.speedup)
        got[m.name] = (round(lo, 3), round(hi, 3))
    (q,) = [m for m in others if m.name.startswith("qwen2-3072")]
    assert q.role == "check" and q.shapes == S.QWEN2_3072 and len(q.shapes) == 29 and not q.others
    assert q.speedup == pytest.approx(61.93 / 51.84, abs=1e-3) and q.bf16_s == pytest.approx(
        0.06193, abs=1e-5
    )
    assert "fp8_vs_bf16_nvidia-h200_2026-11-27c.json" in q.source and q.cite in q.source
    est = S.estimate(q.shapes)
    assert est is not None and est.timed == 29
    assert got[q.name] == (1.103, 1.173) and est.speedup == est.speedup_launch_bound
    assert 0 < est.speedup - cut < 0.005  # right by a hair
    assert q.speedup > max(got[q.name])  # measured above the bracket
    gpt2 = got["gpt2-small without precprof"]
    assert gpt2 == (0.716, 0.955) and gpt2[0] < 0.748 < gpt2[1]  # measured 0.75x: inside
    assert got["Llama3-8B, torchtitan"] == (1.206, 1.223)  # measured 1.25x: above
    # torchao's GPU kernel times against the layers' ends: 0.80x (0.69x to 0.88x), 1.39x (1.56x to 1.62x)
    assert got["torchao Float8Linear, small shapes"] == (0.687, 0.880)
    assert got["torchao Float8Linear, large shapes"] == (1.561, 1.616)


def test_the_interpolation_is_chosen_by_leave_one_out_on_each_table() -> None:
    """Each timed shape predicted from the other 27 (``leave_one_out``): the count of neighbours, 1 to 8, is
    the one whose error of a layer's FP8 speedup is least, judged on each table alone (not on the checks). Four
    on both: graphs 7.0% RMS (six 7.04%, two 8.1%, one 9.4%), call by call 16.0% (five 16.06%, eight 16.09%,
    two 19%): its launch floors, not the interpolation, err there."""
    for table, error in ((S.LAYER_TIMES_GPU, 0.0701), (S.LAYER_TIMES_LAUNCH, 0.1600)):
        runs = {n: S.leave_one_out(n, table) for n in range(1, 9)}
        assert S._NEAREST == min(runs, key=lambda n: runs[n].speedup) == 4
        assert runs[4].speedup == pytest.approx(error, abs=0.0002)
    gpu = {n: S.leave_one_out(n, S.LAYER_TIMES_GPU) for n in (1, 2, 4, 6)}
    four, six, two, one = gpu[4], gpu[6], gpu[2], gpu[1]
    assert six.speedup == pytest.approx(0.0704, abs=0.0002)
    assert two.speedup == pytest.approx(0.0806, abs=0.0002) and one.speedup == pytest.approx(
        0.0937, abs=0.0002
    )
    assert four.interior == pytest.approx(0.0683, abs=0.0002) and two.interior == pytest.approx(
        0.0841, abs=0.0002
    )
    assert four.bf16 == pytest.approx(0.0670, abs=0.0002) and four.fp8 == pytest.approx(0.1121, abs=0.0002)
    assert four.worst[:2] == (1024, 16384) and four.worst[2] == pytest.approx(0.229, abs=0.002)
    launch = {n: S.leave_one_out(n, S.LAYER_TIMES_LAUNCH) for n in (2, 5, 8)}
    assert launch[5].speedup == pytest.approx(0.1606, abs=0.0002) and launch[8].speedup == pytest.approx(
        0.1609, abs=0.0002
    )
    assert launch[2].speedup == pytest.approx(0.1904, abs=0.0002)
    # the method itself: a table whose time per M K N is one constant per format is interpolated exactly
    exact = {(k, n): (2e-6 * k * n, 1.5e-6 * k * n) for k in (512, 1024, 4096) for n in (768, 2048, 8192)}
    for n in (1, 2, 4):
        e = S.leave_one_out(n, exact)
        assert max(e.bf16, e.fp8, e.speedup, e.interior) < 1e-9 and e.nearest == n


def test_the_estimate_explains_itself_and_says_where_its_numbers_come_from() -> None:
    est = S.estimate(GPT2_SMALL, GPT2_HEAD)
    assert est is not None
    text = est.explain()
    for part in (
        "48 converted linear layers",
        "at 0.62x of bf16's speed launched call by call from Python and at 0.80x as CUDA graph replays",
        "all at shapes timed",
        "0.49x to 1.56x call by call, 0.66x to 1.62x as graphs",
        "8.9 or 15.9 ps per element",
        "0.72x if the host's launches bound it, 0.96x if the host keeps ahead of the GPU; the verdict takes the "
        "lower, 0.72x.",
    ):
        assert part in text, (part, text)
    assert "the 1 linear layer left in bf16" in text
    mixed = S.estimate([(TOKENS, 4096, 4096), (TOKENS, 4096, 12288)])
    assert mixed is not None and "1 at shapes timed, the others interpolated" in mixed.explain()
    alone = S.estimate([(TOKENS, 4096, 12288)])
    assert alone is not None and "none at a shape timed: each interpolated" in alone.explain()
    for e in (est, mixed, alone):  # no known miss to say
        assert "Known to mislead" not in e.explain()
    sources = S.sources()
    for m in S.MEASURED:
        assert m.source and m.cite and m.name in sources and m.device in sources and m.cite in sources
    for f in ("fp8_vs_bf16_nvidia-h200_2026-11-27.json", "fp8_vs_bf16_nvidia-h200_2026-11-27b.json"):
        assert f in sources
    assert (
        "a step 1.19x, estimated 1.10x to 1.17x; checked; bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27c"
        in sources
    )
    assert "a step 0.86x, estimated 0.92x to 1.12x; fitted;" in sources and "known miss" not in sources
    assert "fp8_layers_nvidia-h200_2026-11-27c.json (28 shapes" in sources
    assert "timed call by call and as CUDA graph replays" in sources


def test_the_recorded_gpu_runs_would_now_be_judged_right() -> None:
    """bench/fp8_vs_bf16.py's runs on an H200 (bench/results/fp8_vs_bf16_nvidia-h200_2026-11-27*.json): bf16
    against fp8 training, both compiled, with the advisor's verdict of the time. Three verdicts were wrong there
    (qwen2-2048 advised FP8 and ran slower; qwen2-4096 and qwen2-3072 not advised and ran 1.25x and 1.19x
    faster, fp8's loss matching). Where the numbers allowed FP8 (the recorded profile's verdict was decided by
    the speed, or was FP8), the verdict now follows the bracket's lower end, and all four come out right
    (qwen2-3072 by a hair: 1.103x)."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    shapes = {
        "gpt2-small": (S.GPT2_SMALL, S.GPT2_SMALL_HEAD),
        "qwen2-2048": (S.QWEN2_2048 + S.QWEN2_2048_HEAD, ()),
        "qwen2-4096": (S.QWEN2_4096, ()),
        "qwen2-3072": (S.QWEN2_3072, ()),
    }
    cut = AdvisorConfig().fp8_speedup_min
    seen = {}
    for name in (
        "fp8_vs_bf16_nvidia-h200_2026-11-27.json",
        "fp8_vs_bf16_nvidia-h200_2026-11-27b.json",
        "fp8_vs_bf16_nvidia-h200_2026-11-27c.json",
    ):
        for model, rec in json.loads((results / name).read_text())["models"].items():
            profile, outcome = rec["profile"], rec["outcome"]
            assert profile["not_fp8_decided_by"] in ("speed", None)  # the numbers allowed FP8 in all four
            assert profile["fp8_eligible"] == len(shapes[model][0])
            est = S.estimate(*shapes[model])
            assert est is not None
            seen[model] = (est.speedup > cut, outcome["fp8_pays"], outcome["verdict_right"])
    assert seen == {
        "gpt2-small": (False, False, True),
        "qwen2-2048": (False, False, False),
        "qwen2-4096": (True, True, False),
        "qwen2-3072": (True, True, False),
    }
    assert all(now == pays for now, pays, _ in seen.values())


def test_each_step_left_out_of_the_fit_is_judged_as_within_it() -> None:
    """Leave-one-out: each table's rest fitted on the other two steps, gpt2-small comes out at 0.71x to 0.95x
    (0.75x), qwen2-2048 at 0.92x to 1.10x (0.86x) and qwen2-4096 at 1.245x to 1.244x (1.25x; its lower end the
    GPU-bound one): every verdict as within the fit. The layer tables, not the fit, carry the verdicts."""
    cut = AdvisorConfig().fp8_speedup_min
    fitted = [m for m in S.MEASURED if m.role == "fit"]
    got = {}
    for out in fitted:
        constants = S.fit([m for m in fitted if m is not out])
        assert out.name not in constants.fitted_on
        lo, hi, verdict = _ends(out, constants)
        got[out.name.split(",")[0]] = (round(lo, 3), round(hi, 3))
        assert (verdict > 1) == (out.speedup > 1) and (verdict > cut) == (out.speedup > cut)
    assert got == {
        "gpt2-small": (0.710, 0.945),
        "qwen2-2048": (0.923, 1.102),
        "qwen2-4096": (1.245, 1.244),
    }
