"""One classification of modules: the live module and its type name in the tables agree."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from precprof import tables as T
from precprof import taxonomy as X

MODULES = [
    (nn.Linear(4, 4), X.MATMUL),
    (nn.Conv2d(1, 1, 3), X.MATMUL),
    (nn.ConvTranspose1d(1, 1, 3), X.MATMUL),
    (nn.Bilinear(2, 2, 2), X.MATMUL),
    (nn.LayerNorm(4), X.NORM),
    (nn.BatchNorm1d(4), X.NORM),
    (nn.GroupNorm(2, 4), X.NORM),
    (nn.RMSNorm(4), X.NORM),
    (nn.Softmax(dim=-1), X.SOFTMAX),
    (nn.LogSoftmax(dim=-1), X.SOFTMAX),
    (nn.CrossEntropyLoss(), X.LOSS),
    (nn.MSELoss(), X.LOSS),
    (nn.GELU(), X.ELEMENTWISE),
    (nn.ReLU(inplace=True), X.ELEMENTWISE),
    (nn.Dropout(0.1), X.ELEMENTWISE),
    (nn.Embedding(8, 4), X.EMBEDDING),
    (nn.Sequential(nn.Linear(2, 2)), X.OTHER),
    # torch's parametrizations compute a layer's weight: no normalisation layer, whatever their names say
    (parametrizations._WeightNorm(dim=0), X.OTHER),
    (parametrizations._SpectralNorm(torch.ones(4, 4)), X.OTHER),
]


@pytest.mark.parametrize(("module", "kind"), MODULES, ids=[type(m).__name__ for m, _ in MODULES])
def test_module_and_type_name_agree(module: nn.Module, kind: str) -> None:
    assert X.kind_of(module) == kind
    assert X.kind_of_type(type(module).__name__) == kind


def test_hugging_face_modules() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    kinds = {type(m).__name__: X.kind_of(m) for m in model.modules()}
    assert kinds["Conv1D"] == X.MATMUL and kinds["LayerNorm"] == X.NORM and kinds["Embedding"] == X.EMBEDDING
    for m in model.modules():  # every type the tables could name is classified as the live module is
        if X.kind_of_type(type(m).__name__) != X.OTHER:
            assert X.kind_of_type(type(m).__name__) == X.kind_of(m), type(m).__name__


def test_live_module_refinements() -> None:
    class Proj(nn.Linear):  # a renamed Linear: only the live module can tell
        pass

    class Gate(nn.Module):  # a leaf holding a matrix
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(4, 4))

    assert X.kind_of(Proj(4, 4)) == X.MATMUL and X.kind_of(Gate()) == X.MATMUL


def test_fp8_eligibility() -> None:
    emb = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "ok": nn.Linear(32, 48), "odd": nn.Linear(32, 50)})
    tied = X.tied_weight_ids(model)
    assert [n for n, m in model.items() if X.fp8_eligible(m, tied)] == ["ok"]
    assert X.fp8_eligible_names(model) == ["ok"]
    # the tokens per call (batch x sequence) count too, when known
    assert X.fp8_eligible_names(model, tokens=32) == ["ok"] and X.fp8_eligible_names(model, tokens=28) == []


def test_fp8_ineligible_reason() -> None:
    r = X.fp8_ineligible_reason
    assert r(32, 48) == "" and X.fp8_eligible_shape(32, 48, tokens=64)
    assert r(32, 48, tied=True) == "tied to an embedding"
    assert r(None, 48) == "weight shape unknown" and not X.fp8_eligible_shape(None, None)
    assert r(100, 300) == "dims 100x300 not multiples of 16"
    assert r(32, 48, tokens=21) == "21 tokens per call, not a multiple of 16"
    # what a float8 conversion swaps: nn.Linear by name, not HF's Conv1D nor convolutions
    assert X.fp8_convertible_type("Linear") and X.fp8_convertible_type("Float8Linear")
    assert not any(map(X.fp8_convertible_type, ["Conv1D", "Conv2d", "Embedding", ""]))


def test_mixed_precision_check() -> None:
    rows = [
        {T.STEP: 3, T.MODULE: "a", T.MODULE_TYPE: "Linear", T.TENSOR: T.ACTIVATION, T.DTYPE: "bfloat16"},
        {T.STEP: 3, T.MODULE: "b", T.MODULE_TYPE: "Conv1D", T.TENSOR: T.ACTIVATION, T.DTYPE: "float32"},
        {T.STEP: 3, T.MODULE: "n", T.MODULE_TYPE: "LayerNorm", T.TENSOR: T.ACTIVATION, T.DTYPE: "float32"},
    ]
    layers = T.frame("layers", pd.DataFrame(rows))
    check = X.mixed_precision_check("bf16", layers)
    assert check == {
        "mixed_precision_requested": "bf16",
        "mixed_precision_active": True,
        "matmul_layers_float32": 1,
        "matmul_layers": 2,
    }
    assert X.mixed_precision_check("fp32", layers)["mixed_precision_active"] is False
    assert X.low_precision_seen(layers) and not X.low_precision_seen(layers[layers[T.DTYPE] == "float32"])


def test_linear_types_are_the_matmuls_fp8_converts() -> None:
    linear = ["Linear", "NonDynamicallyQuantizableLinear", "Float8Linear", "Conv1D"]
    assert all(X.is_linear_type(t) for t in linear)
    assert not any(
        X.is_linear_type(t) for t in ["Conv2d", "Bilinear", "Embedding", "LayerNorm", "Conv1DWrapper"]
    )


def test_fp8_linear_layers_reads_a_missing_module_type_as_none() -> None:
    # a layers table whose module type is missing for a row (read back as NaN: pandas 3's astype(str) keeps
    # it NaN, and the type's regular expressions raised TypeError; found by the advisor's property test)
    layers = pd.DataFrame(
        {
            T.MODULE: ["a", "b", "c", "d"],
            T.MODULE_TYPE: pd.Series(["Float8Linear", None, "Linear", float("nan")], dtype="str"),
        }
    )
    assert X.fp8_linear_layers(layers) == (["a"], 2)


def test_fp8_linear_layers_reads_a_column_of_missing_types_without_a_warning() -> None:
    # every type missing: the column is float64, and ``fillna("")`` on it warns that a future pandas raises
    layers = pd.DataFrame({T.MODULE: ["a", "b"], T.MODULE_TYPE: [float("nan")] * 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert X.fp8_linear_layers(layers) == ([], 0)


@pytest.mark.parametrize(
    ("name", "routed"),
    [
        ("model.layers.0.mlp.experts.3.up_proj", True),  # transformers 4's Mixtral, Qwen2-MoE, DeepSeek
        ("model.layers.0.block_sparse_moe.experts.7.w1", True),
        ("encoder.block.1.layer.1.mlp.experts.expert_0.wi", True),  # Switch Transformers
        ("layers.2.deepspeed_moe.experts.deepspeed_experts.0.fc1", True),  # DeepSpeed-MoE
        ("model.layers.0.mlp.shared_expert.up_proj", False),  # Qwen2-MoE's expert every token goes through
        ("model.layers.0.mlp.shared_experts.up_proj", False),  # DeepSeek's
        ("model.layers.0.mlp.gate", False),  # the router sees every token
        (
            "model.layers.0.mlp.experts",
            False,
        ),  # a bank of 3-D weights (transformers 5): a module, not inside one
        ("transformer.h.0.mlp.c_fc", False),
    ],
)
def test_routed_experts_are_told_from_shared_experts_and_routers(name: str, routed: bool) -> None:
    assert X.routed_expert(name) is routed
