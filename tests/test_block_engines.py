"""The block-format what-if in the engines and the profiler: the C kernel (``pp_block``) against the torch-op
reference ``block_formats.block_stats`` (exact counts, sums to summation order), and a profiled model's block
columns against ``block_stats`` of the same tensors captured with plain hooks."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from _s129a_interpreter import skip_nested_patching
from test_block_formats import AMAX_BINADES, boundary_blocks_at
from torch import nn

from precprof import block_formats as bf
from precprof import tables as T
from precprof.capture import Profiler
from precprof.stats import StatsBuffer, blocks, kernel, triton_block
from precprof.stats.engine import ENGINE_ENV

RECIPES = bf.column_recipes()
# tiny tensors: torch's second thread only spins (on a busy machine a torch.round took 9 ms)
pytestmark = pytest.mark.usefixtures("one_thread")
needs_c = pytest.mark.skipif(kernel.load() is None, reason="the C kernel does not build here")


@pytest.fixture(scope="module", autouse=True)
def _interpreter_patches_once_a_launch() -> Iterator[None]:
    """In the interpreter, a launch patches triton.language once, not again at each call of a kernel's helper
    (tests/_s129a_interpreter.py: the same arithmetic, less CPU time)."""
    with skip_nested_patching():
        yield


def reference(x: torch.Tensor, axis: int) -> torch.Tensor:
    """[recipes, 5] float64 from block_formats.block_stats, one recipe at a time."""
    return torch.stack(
        [torch.stack([bf.block_stats(x, r, axis)[s].double() for s in T.BLOCK_STATS]) for r in RECIPES]
    )


def row_cells(row: pd.Series) -> torch.Tensor:
    """A layers row's block cells as float64 [orientation, recipe, stat]."""
    return torch.tensor(
        [
            [[row[T.block_col(r, st, o)] for st in T.BLOCK_STATS] for r in T.BLOCK_RECIPES]
            for o in T.BLOCK_ORIENTATIONS
        ],
        dtype=torch.float64,
    )


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    counts = [T.BLOCK_STATS.index(s) for s in ("flushed", "saturated", "poisoned")]
    sums = [T.BLOCK_STATS.index(s) for s in ("sum_x2", "sum_err2")]
    assert torch.equal(got[..., counts], want[..., counts]), f"{what}\n{got}\n{want}"
    torch.testing.assert_close(got[..., sums], want[..., sums], rtol=1e-12, atol=0, msg=what)


def test_column_recipes_are_the_tables_recipes() -> None:
    assert tuple(r.name for r in RECIPES) == T.BLOCK_RECIPES
    by_name = {r.name: r for r in RECIPES}
    assert by_name["mxfp8_e4m3_rceil"].scale_mode == bf.ScaleMode.RCEIL
    assert by_name["mxfp8_e4m3_rceil"].element is bf.MXFP8_E4M3.element
    assert by_name["mxfp8_e4m3"] == bf.MXFP8_E4M3
    assert by_name["nvfp4"] == bf.NVFP4


def hard_tensor(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values spread over many binades per row, with zeros, outliers, exact powers of two, values of
    the formats' subnormal range and (by seed) a nan or an inf block, and fp32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float())
    flat = x.view(-1)
    n = flat.numel()
    flat[torch.rand(n, generator=g) < 0.05] = 0.0
    pick = torch.randint(0, n, (4,), generator=g)
    flat[pick[0]] = 3e3  # an outlier: the rest of its block flushes in the narrow formats
    flat[pick[1]] = 2.0**-3  # an exact power of two
    flat[pick[2]] = -(2.0**-20)
    if seed % 3 == 1:
        flat[pick[3]] = math.nan
    elif seed % 3 == 2:
        flat[pick[3]] = -math.inf
    if seed % 4 == 3 and dtype == torch.float32:
        flat[: n // 3] *= 2.0**-135  # fp32 subnormals and tiny normals
    return x.to(dtype)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape,seed",
    [
        ((7, 45), 0),
        ((33, 64), 1),
        ((65, 31), 2),
        ((3, 2, 50), 3),
        ((40, 96), 4),
        ((1, 17), 5),
        # every block shorter than half a block (NVFP4's) in a row tile, a tile's lanes partly empty
        ((9, 8), 6),
        ((70, 3), 7),
    ],
)
def test_c_kernel_equals_the_reference(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> None:
    x = hard_tensor(shape, seed, dtype)
    x2 = x.reshape(-1, shape[-1])
    both = kernel.block_stats_2d(x, RECIPES, 3, threads=2)
    assert_same(both[0], reference(x, -1), f"row {dtype} {shape}")
    assert_same(both[1], reference(x2, -2), f"col {dtype} {shape}")
    # the one-axis entry (the Triton kernel's signature) gives the same numbers
    assert torch.equal(kernel.block_stats_c(x2, RECIPES, -2), both[1])
    assert torch.equal(kernel.block_stats_c(x, RECIPES, -1), both[0])


@needs_c
def test_c_kernel_block_amaxes_from_fp32s_lowest_binade_to_its_highest() -> None:
    # A tile whose block amaxes all lie in [2^-90, 2^101) (or are 0) has its MX scales carried to the bounds
    # (kernel.c's tile_mx_bounds); any other is computed as the reference computes it. One binade at a time,
    # every MX recipe in both scale modes and NVFP4, both orientations
    mx = [bf.get_recipe(n, m) for n in bf.RECIPES if n != "nvfp4" for m in ("floor", "rceil")]
    recipes = [*mx, bf.NVFP4]
    for binade in AMAX_BINADES:
        x = boundary_blocks_at(binade)
        want = [
            torch.stack(
                [torch.stack([bf.block_stats(x, r, a)[s].double() for s in T.BLOCK_STATS]) for r in recipes]
            )
            for a in (-1, -2)
        ]
        got = kernel.block_stats_2d(x, recipes, 3, threads=1)
        assert_same(got[0], want[0], f"row, amax binade {binade}")
        assert_same(got[1], want[1], f"col, amax binade {binade}")


@needs_c
def test_c_kernel_edge_values_and_a_non_contiguous_view() -> None:
    # values at the rounding ties and saturation edges of every element format, scaled into one block each
    big = [448.0, 464.0, 465.0, 57344.0, 61440.0, 7.5, 7.75, 28.0, 30.0, 6.0, 6.5, 7.0, 0.25, 0.75]
    small = [2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 2.0**-17, 0.0, -0.0, 1.0, -1.0]
    edge = torch.tensor([*big, *small])
    x = torch.cat([edge * 2.0**k for k in (-8, 0, 3)]).reshape(3, -1)
    x = torch.cat([x, -x.flip(1)], dim=1)
    assert_same(kernel.block_stats_c(x, RECIPES, -1), reference(x, -1), "edges, row")
    assert_same(kernel.block_stats_c(x, RECIPES, -2), reference(x, -2), "edges, col")
    t = hard_tensor((48, 40), 7, torch.float32).t()  # a transposed view: read through a contiguous copy
    assert_same(kernel.block_stats_c(t, RECIPES, -1), reference(t, -1), "transposed view")
    nan_all = torch.full((4, 20), math.nan)  # every block poisoned; NVFP4: the whole tensor
    assert_same(kernel.block_stats_c(nan_all, RECIPES, -2), reference(nan_all, -2), "all nan")
    zeros = torch.zeros(5, 33)
    assert_same(kernel.block_stats_c(zeros, RECIPES, -1), reference(zeros, -1), "all zero")


@needs_c
def test_c_kernel_sums_repeat_bit_for_bit_over_thread_counts() -> None:
    x = hard_tensor((300, 384), 8, torch.float32)  # 115k values: several chunks, split over threads
    one = kernel.block_stats_2d(x, RECIPES, 3, threads=1)
    two = kernel.block_stats_2d(x, RECIPES, 3, threads=2)
    assert torch.equal(one, two)
    assert torch.equal(one, kernel.block_stats_2d(x, RECIPES, 3, threads=2))
    # the numbers themselves: the torch engine, which reads every recipe at once per orientation
    assert_same(one, blocks.tensor_block_stats(x, engine="torch"), "large")


@needs_c
def test_c_kernel_adds_into_the_accumulator_as_an_addition_of_its_result() -> None:
    """``add_tensor_block_stats`` (the C kernel adding into an accumulator slot) gives bitwise what adding
    ``tensor_block_stats`` gives, over several tensors of each dtype, a non-contiguous one among them; a slot
    that is not contiguous takes the addition path."""
    acc = torch.zeros(3, 2, len(RECIPES), 5, dtype=torch.float64)
    want = acc.clone()
    for seed, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float32)):
        x = hard_tensor((24, 64), seed, dtype)
        if seed == 3:
            x = x.t()
        blocks.add_tensor_block_stats(x, acc[1], engine="c", threads=1)
        want[1] += blocks.tensor_block_stats(x, engine="c", threads=1)
    assert torch.equal(acc, want) and acc[1].abs().sum() > 0 and not acc[0].any() and not acc[2].any()
    strided = torch.zeros(2, len(RECIPES), 5, 2, dtype=torch.float64)[..., 0]
    blocks.add_tensor_block_stats(hard_tensor((8, 32), 5, torch.float32), strided, engine="c", threads=1)
    assert torch.equal(strided, blocks.tensor_block_stats(hard_tensor((8, 32), 5, torch.float32), engine="c"))


def test_dispatch_engines_agree_and_reject_what_they_cannot_read() -> None:
    x = hard_tensor((20, 70), 9, torch.bfloat16)
    torch_ops = blocks.tensor_block_stats(x, engine="torch")
    assert torch_ops.shape == (2, len(RECIPES), len(T.BLOCK_STATS)) and torch_ops.dtype == torch.float64
    assert_same(torch_ops[1], reference(x, -2), "torch engine, col")
    if kernel.load() is not None:
        assert_same(blocks.tensor_block_stats(x, engine="c"), torch_ops, "c against torch")
        # a dtype the C kernel does not read goes to torch ops
        x64 = x.double()
        assert_same(blocks.tensor_block_stats(x64.float(), engine="c"), torch_ops, "fp32 of bf16")
        with pytest.raises(Exception, match="fp32, bf16 or fp16"):
            kernel.block_stats_c(x64, RECIPES, -1)
        with pytest.raises(Exception, match="columns of a 2-D"):
            kernel.block_stats_c(x.reshape(2, 10, 70), RECIPES, -2)


# ----------------------------------------------------------------------------------------------- profiler
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(48, 80)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(80, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def train(
    model: nn.Module, steps: int, profile: dict | None, plain: dict | None = None
) -> tuple[list[float], Profiler | None]:
    """fp16 autocast on the CPU with a GradScaler, profiled with the Profiler arguments ``profile`` (None: not
    profiled); ``plain`` collects, per step, the loss scale of the backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    prof = None
    if profile is not None:
        prof = Profiler(model, optimizer=opt, scaler=scaler, **profile).attach()
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            x = torch.randn(6, 5, 48, generator=g) * 3.0
            y = torch.randn(6, 5, 40, generator=g)
            if plain is not None:
                plain["scales"].append(scaler.get_scale())
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if prof is not None:
                prof.step(loss=loss.detach())
            losses.append(loss.item())
    finally:
        if prof is not None:
            prof.detach()
    return losses, prof


# The module whose output each linear layer reads as its input; fc1 reads the model's input, which no module
# produced: it is recorded under fc1's own input row
PRODUCER = {"fc2": "act", "fc1": T.input_module("fc1")}


def plain_capture(model: nn.Module, plain: dict) -> list:
    """Independent hooks on what a block-scaled GEMM quantises: each linear layer's weight and input (recorded
    under the module that produced the input), and its output gradient (scaled)."""
    handles = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue

        def pre(m: nn.Module, args: tuple, name: str = name) -> None:
            step = len(plain["scales"]) - 1
            plain["tensors"].append((step, name, T.WEIGHT, m.weight.detach().clone()))
            if name in PRODUCER:
                plain["tensors"].append((step, PRODUCER[name], T.ACTIVATION, args[0].detach().clone()))

        def fwd(m: nn.Module, args: object, out: torch.Tensor, name: str = name) -> None:
            step = len(plain["scales"]) - 1
            out.register_hook(
                lambda g: plain["tensors"].append((step, name, T.ACTIVATION_GRAD, g.detach().clone()))
            )

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(fwd)]
    return handles


@pytest.mark.parametrize("engine", ["c", "torch", "triton"])
def test_profiled_model_block_columns_equal_block_stats_of_the_same_tensors(
    engine: str, monkeypatch: pytest.MonkeyPatch, block_formats_on: None
) -> None:
    if engine == "c" and kernel.load() is None:
        pytest.skip("the C kernel does not build here")
    if engine == "triton" and triton_block.unavailable(torch.device("cpu")) is not None:
        pytest.skip(str(triton_block.unavailable(torch.device("cpu"))))
    monkeypatch.setenv(ENGINE_ENV, engine)
    torch.manual_seed(0)
    model = MLP()
    ref_model = copy.deepcopy(model)
    plain: dict = {"scales": [], "tensors": []}
    handles = plain_capture(model, plain)
    # (compiled at attach: the Triton engine samples from the first step, as the others do)
    kw = {"sample_every": 1, "memory": False, "block_groups": 1, "compile_beside": False}
    losses, prof = train(model, 2, kw, plain)
    for h in handles:
        h.remove()
    assert prof is not None and prof._buffer is not None
    assert set(prof._buffer.engines.values()) == {engine}
    if (
        engine == "triton"
    ):  # the Triton block kernels read them, both orientations into the slot in one launch
        assert prof._buffer.primary._triton_blocks is not None  # type: ignore[union-attr]
    assert len(set(plain["scales"])) == 2  # the scale grew between the steps: both unscalings are checked

    # training unchanged, bit for bit, with the block statistics on
    assert train(ref_model, 2, None)[0] == losses
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)

    want: dict[tuple[int, str, str], torch.Tensor] = {}
    for step, name, kind, t in plain["tensors"]:
        t2 = t.reshape(-1, t.shape[-1])
        stats = torch.stack([reference(t2, -1), reference(t2, -2)])
        if kind == T.ACTIVATION_GRAD:  # sums unscaled like every other column; counts as the GEMM reads them
            stats[..., 3:] /= plain["scales"][step] ** 2
        key = (step, name, kind)
        want[key] = want[key] + stats if key in want else stats

    layers = prof.tables()["layers"]
    assert sorted(set(layers[T.STEP])) == [0, 1]
    checked = 0
    for _, row in layers.iterrows():
        key = (int(row[T.STEP]), row[T.MODULE], row[T.TENSOR])
        got = row_cells(row)
        if key not in want or (row[T.TENSOR] == T.WEIGHT and row[T.PARAM] != "weight"):
            # not read by a block-scaled GEMM: not evaluated (weight gradients, biases, fc1's output, which
            # only GELU reads, fc2's output, act's gradient)
            assert got.isnan().all(), key
            continue
        assert_same(got, want[key], str(key))
        checked += 1
    # per step: 2 weights, 2 output gradients, act's output (fc2's input), the model's input (fc1's)
    assert checked == 2 * 6
    assert (layers[T.block_col("mxfp4", "sum_x2")].dropna() > 0).all()


def block_cells(layers: pd.DataFrame) -> dict[tuple[int, str, str, str], np.ndarray]:
    """Every row's block columns, by (step, module, tensor, param)."""
    cols = list(T.BLOCK_COLUMNS)
    return {
        (int(r[T.STEP]), r[T.MODULE], r[T.TENSOR], str(r[T.PARAM])): r[cols].to_numpy(dtype=np.float64)
        for _, r in layers.iterrows()
    }


def test_block_groups_take_turns_and_give_the_same_numbers(block_formats_on: None) -> None:
    """block_groups=2: the linear layers are dealt into two groups by size (fc1 48+80, then fc2 80+40); step k
    evaluates group k % 2 (fc1's weight, output gradient and input, the model's; then fc2's weight, output
    gradient and its input, act's output), and what it evaluates equals the run that evaluates every layer on every step."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    _, every = train(model, 4, {"sample_every": 1, "memory": False, "block_groups": 1})
    _, turns = train(twin, 4, {"sample_every": 1, "memory": False, "block_groups": 2})
    assert every is not None and turns is not None
    all_cells = block_cells(every.tables()["layers"])
    turn_cells = block_cells(turns.tables()["layers"])
    assert all_cells.keys() == turn_cells.keys()
    group = {"fc1": 0, T.input_module("fc1"): 0, "fc2": 1, "act": 1}  # act's output is fc2's input
    evaluated = 0
    for key, want in all_cells.items():
        step, module, _, _ = key
        got = turn_cells[key]
        if np.isnan(want).all() or group[module] != step % 2:
            assert np.isnan(got).all(), key
            continue
        np.testing.assert_array_equal(got, want, err_msg=str(key))
        evaluated += 1
    assert evaluated == 2 * 3 + 2 * 3  # fc1's 3 operands on steps 0 and 2, fc2's 3 on steps 1 and 3
    assert turns.summary()["block_formats"] == {
        "groups": 2,
        "adaptive": False,
        "layers": 2,  # fc1 and fc2
        "layers_evaluated": 2,
        "evaluations": [2, 2],  # each on 2 of the 4 sampled steps
    }
    with pytest.raises(ValueError, match=r"Profiler\(block_groups=0\): expected a whole number >= 1"):
        Profiler(MLP(), block_groups=0)


class TwoReaders(nn.Module):
    """act's output is read by two linear layers, like q and k projections reading one norm's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(48, 64)
        self.act = nn.GELU()
        self.q = nn.Linear(64, 40)
        self.k = nn.Linear(64, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        return self.q(h) + self.k(h)


def test_an_output_read_by_two_linear_layers_counts_once(block_formats_on: None) -> None:
    """The block cells of act's output equal block_stats of that tensor once, like its numel: the share of a
    tensor that two GEMMs read is not doubled."""
    h2, layers = act_seen_and_layers(TwoReaders())
    row = layers[(layers[T.MODULE] == "act") & (layers[T.TENSOR] == T.ACTIVATION)].iloc[0]
    assert int(row[T.NUMEL]) == h2.numel()
    assert_same(row_cells(row), torch.stack([reference(h2, -1), reference(h2, -2)]), "act read by q and k")


def act_seen_and_layers(model: TwoReaders) -> tuple[torch.Tensor, pd.DataFrame]:
    """``model`` trained one sampled step, every layer's block formats evaluated: act's output as a plain hook
    saw it (2-D), and the layers table."""
    torch.manual_seed(0)
    seen: list[torch.Tensor] = []
    model.act.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    _, prof = train(model, 1, {"sample_every": 1, "memory": False, "block_groups": 1})
    assert prof is not None
    (h,) = seen
    return h.reshape(-1, h.shape[-1]), prof.tables()["layers"]


class ViewReaders(TwoReaders):
    """q and k read act's output through new tensor objects over its memory (``view``), as FSDP2's hooks hand
    a layer a tensor of its own; the objects die before the next module runs, and one reader's tensor has
    another shape (another tensor, for the block formats)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        return self.q(h.view(h.shape)) + self.k(h.view(-1, h.shape[-1])).view(*h.shape[:-1], 40)


def test_a_new_object_over_a_modules_output_is_that_output(block_formats_on: None) -> None:
    """A linear layer's input that is another tensor object over the memory of a module's output, with its
    shape and strides, is matched to that output (counted once, under act's row); one of another shape is not
    (a row of its own, its block cells those of the 2-D tensor the layer read)."""
    h2, layers = act_seen_and_layers(ViewReaders())
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    assert set(acts[T.MODULE]) == {T.input_module("fc1"), "fc1", "act", "q", "k", T.input_module("k")}
    for module in ("act", T.input_module("k")):
        row = acts[acts[T.MODULE] == module].iloc[0]
        assert int(row[T.NUMEL]) == h2.numel()
        assert_same(row_cells(row), torch.stack([reference(h2, -1), reference(h2, -2)]), module)


class Attention(nn.Module):
    """The output projection reads a function's output (scaled_dot_product_attention), as in every GPT."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(48)
        self.qkv = nn.Linear(48, 3 * 48)
        self.proj = nn.Linear(48, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_a_linear_input_no_module_produced_gets_a_row_of_its_own(block_formats_on: None) -> None:
    """proj reads the attention's output: a row of its own (``proj:input``) holds that tensor's statistics, the
    same as a module's output row would (numel, largest magnitude, block cells equal block_stats of the tensor
    an independent hook saw), and the block plan judges proj's input from it. qkv's input, the LayerNorm's
    output, stays under the LayerNorm: no row of its own."""
    torch.manual_seed(0)
    model = Attention()
    seen: list[torch.Tensor] = []
    model.proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    _, prof = train(model, 1, {"sample_every": 1, "memory": False, "block_groups": 1})
    assert prof is not None
    layers = prof.tables()["layers"]
    acts = layers[layers[T.TENSOR] == T.ACTIVATION]
    assert set(acts[T.MODULE]) == {"ln", "qkv", "proj", T.input_module("proj")}
    row = acts[acts[T.MODULE] == T.input_module("proj")].iloc[0]
    (h,) = seen
    assert row[T.MODULE_TYPE] == T.INPUT_MODULE_TYPE and row[T.DTYPE] == str(h.dtype).removeprefix("torch.")
    assert int(row[T.NUMEL]) == h.numel() and float(row[T.ABSMAX]) == float(h.abs().max())
    assert int(row[T.ORDER]) == int(acts[acts[T.MODULE] == "proj"].iloc[0][T.ORDER]) - 1  # just before proj
    h2 = h.reshape(-1, h.shape[-1])
    got = row_cells(row)
    assert_same(got, torch.stack([reference(h2, -1), reference(h2, -2)]), "proj's input")
    from precprof.analysis.advisor.rules.blocks import block_table

    plan = {lb.module: lb for lb in block_table(layers, {T.SUMMARY_CAPTURE: prof.summary()})}
    assert plan["proj"].input_from == T.input_module("proj")
    assert plan["qkv"].input_from == "ln"
    assert all(lb.input_from is not None for lb in plan.values())


def test_block_groups_are_dealt_by_size() -> None:
    """Largest first, each to the lightest group (cost: in + out features): 128 | 72, 16, 16."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(64, 64), nn.Linear(8, 8), nn.Linear(64, 8))
    prof = Profiler(model, block_groups=2).attach()
    try:
        groups = {s.name: s.block_group for s in prof._modules if isinstance(s.module, nn.Linear)}
    finally:
        prof.detach()
    assert groups == {"0": 1, "1": 0, "2": 1, "3": 1}


def test_block_formats_default_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("PRECPROF_BLOCK_FORMATS", value)
        assert Profiler(MLP())._block_formats is on, value
    monkeypatch.delenv("PRECPROF_BLOCK_FORMATS")
    assert Profiler(MLP())._block_formats is True  # on by default
    assert Profiler(MLP(), block_formats=False)._block_formats is False  # the argument wins


def test_block_formats_off_leaves_the_columns_empty() -> None:
    torch.manual_seed(0)
    model = MLP()
    _, prof = train(model, 1, {"sample_every": 1, "memory": False, "block_formats": False})
    assert prof is not None
    layers = prof.tables()["layers"]
    assert len(layers) and layers[list(T.BLOCK_COLUMNS)].isna().all().all()


def test_buffer_adds_blocks_over_calls_and_devices_rows_merge() -> None:
    x = hard_tensor((10, 64), 10, torch.float32)
    y = hard_tensor((4, 3, 32), 11, torch.bfloat16)
    buf = StatsBuffer(2, "cpu", engine="torch")
    buf.accumulate(x, 1, blocks=True)
    buf.accumulate(y, 1, blocks=True)
    buf.accumulate(x[0], 0, blocks=True)  # 1-D: no block statistics
    assert buf.blocks_seen.tolist() == [False, True]
    host = buf.blocks_to_host()
    want = blocks.tensor_block_stats(x) + blocks.tensor_block_stats(y)
    assert_same(torch.from_numpy(host[1]), want, "two calls")
    assert np.all(host[0] == 0)
    assert torch.equal(buf.blocks_dense(), torch.from_numpy(host))
    buf.reset()
    assert not buf.blocks_seen.any() and np.all(buf.blocks_to_host() == 0)


@needs_c
def test_c_buffer_adds_blocks_as_the_general_path_does() -> None:
    """The CPU rows' own C path (``HostRows.accumulate_blocks``, arguments in one array) adds bitwise what the
    general path (``blocks.add_tensor_block_stats``) adds, over dtypes, a 3-d and a transposed tensor, into
    the right slot (the second); the same tensor again adds nothing, changed in place it adds again."""
    tensors = [
        hard_tensor((24, 64), 0, torch.float32),
        hard_tensor((4, 3, 40), 1, torch.bfloat16),
        hard_tensor((9, 8), 2, torch.float16),
        hard_tensor((48, 40), 3, torch.float32).t(),
    ]
    buf = StatsBuffer(3, "cpu", engine="c", block_rows=[2, 0])
    want = torch.zeros(2, len(RECIPES), 5, dtype=torch.float64)
    for t in tensors:
        buf.accumulate_blocks(t, 2)
        blocks.add_tensor_block_stats(t, want, engine="c", threads=1)
    buf.accumulate_blocks(tensors[0], 2)  # the same tensor, unchanged: counted once
    host = buf.blocks_to_host()
    assert torch.equal(torch.from_numpy(host[2]), want) and want[..., 3].min() > 0
    assert np.all(host[0] == 0) and np.all(host[1] == 0)
    tensors[0].mul_(2.0)  # changed in place: read again
    buf.accumulate_blocks(tensors[0], 2)
    blocks.add_tensor_block_stats(tensors[0], want, engine="c", threads=1)
    assert torch.equal(torch.from_numpy(buf.blocks_to_host()[2]), want)


@pytest.mark.parametrize("engine", ["c", "torch"])
def test_many_tensors_add_blocks_as_one_by_one(engine: str) -> None:
    """``accumulate_blocks_many`` (a sampled step's weights: one C call) adds what ``accumulate_blocks`` of each
    adds: over dtypes, a transposed tensor (read through a copy), a 1-D one and a row without a slot (neither
    evaluated); called again after the tensors changed in place (the kept arrays, the same memory), it reads
    the new values."""
    if engine == "c" and kernel.load() is None:
        pytest.skip("the C kernel does not build here")
    tensors = [
        hard_tensor((24, 64), 0, torch.float32),
        hard_tensor((16, 40), 1, torch.bfloat16),
        hard_tensor((48, 40), 3, torch.float32).t(),
        hard_tensor((9, 8), 2, torch.float16),
        hard_tensor((33,), 4, torch.float32),
        hard_tensor((8, 8), 5, torch.float32),
    ]
    rows = [0, 1, 2, 3, 4, 5]
    many = StatsBuffer(6, "cpu", engine=engine, block_rows=[0, 1, 2, 3, 4])
    one = StatsBuffer(6, "cpu", engine=engine, block_rows=[0, 1, 2, 3, 4])
    for _ in range(2):
        many.accumulate_blocks_many(tensors, rows)
        for t, r in zip(tensors, rows, strict=True):
            one.accumulate_blocks(t, r)
        got, want = many.blocks_to_host(), one.blocks_to_host()
        np.testing.assert_array_equal(got, want)
        assert many.blocks_seen.tolist() == one.blocks_seen.tolist() == [True] * 4 + [False] * 2
        assert np.all(got[:4, :, 0, 3] > 0) and np.all(got[4:] == 0)
        for t in tensors:
            t.mul_(-3.0)
        one.reset()  # a fresh start for the one-by-one path (its tensors' versions changed anyway)
        many.reset()


def test_buffer_keeps_block_slots_only_for_the_rows_that_can_hold_them() -> None:
    """block_rows=[1, 3] of 4 rows: two slots; rows 0 and 2 take no block statistics (neither through
    accumulate(blocks=True) nor accumulate_blocks), the slots land back in rows 1 and 3, a partial reset
    clears only its rows, and the accumulator is half the size of one with a slot per row."""
    x = hard_tensor((10, 64), 10, torch.float32)
    y = hard_tensor((4, 3, 32), 11, torch.bfloat16)
    buf = StatsBuffer(4, "cpu", engine="torch", block_rows=[3, 1])
    full = StatsBuffer(4, "cpu", engine="torch")
    buf.accumulate(x, 0, blocks=True)
    buf.accumulate_blocks(x, 2)
    buf.accumulate(x, 1, blocks=True)
    buf.accumulate_blocks(y, 3)
    assert buf.blocks_seen.tolist() == [False, True, False, True]
    assert buf.blocks_dense().shape[0] == 2
    host = buf.blocks_to_host()
    assert host.shape[0] == 4 and np.all(host[[0, 2]] == 0)
    assert_same(torch.from_numpy(host[1]), blocks.tensor_block_stats(x), "row 1")
    assert_same(torch.from_numpy(host[3]), blocks.tensor_block_stats(y), "row 3")
    np.testing.assert_array_equal(buf.expand_blocks(buf.blocks_dense().numpy()), host)
    buf.reset(slice(1, 2))
    host = buf.blocks_to_host()
    assert np.all(host[1] == 0) and np.any(host[3] != 0)
    # fresh buffers (the histogram window grows with the data): two slots cost half of four
    none = StatsBuffer(4, "cpu", engine="torch", block_rows=[]).buffer_bytes
    half = StatsBuffer(4, "cpu", engine="torch", block_rows=[1, 3]).buffer_bytes
    assert half - none == (full.buffer_bytes - none) // 2 > 0
