"""Built-in models (sizes, causality, equivalence with Hugging Face's GPT-2 and Llama given the same weights),
model arguments, hf: models and user factories."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from precprof import _quiet_imports, models
from precprof.errors import MissingDependencyError, UserError
from precprof.models import (
    BUILTIN_MODELS,
    approx_params,
    base,
    build_model,
    count_params,
    parse_model_args,
    registry,
)

pytestmark = pytest.mark.usefixtures("one_thread")
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
SMALL = {"gpt-mini": {"n_layer": "1"}}


def test_preset_sizes() -> None:
    nano = build_model("gpt-nano", vocab_size=256, seq_len=64)
    assert 0.4e6 < count_params(nano.module) < 0.6e6
    mini = build_model("gpt-mini", vocab_size=256, seq_len=64)
    assert 9e6 < count_params(mini.module) < 12e6
    assert nano.info()["n_params"] == count_params(nano.module)
    assert nano.info()["n_embd"] == 96 and nano.vocab_size == 256


def test_gpt2_configurations_have_the_published_sizes() -> None:
    # GPT-2 small: 124,439,808 parameters with tied embeddings (nanoGPT prints 123.65M without wpe)
    for name, expected in (("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168)):
        spec = BUILTIN_MODELS[name]
        cfg = spec.config()
        with torch.device("meta"):
            module = spec.build(cfg)
        assert count_params(module) == expected, name
        assert abs(approx_params(cfg) - expected) / expected < 0.002


@pytest.mark.parametrize("name", [n for n in BUILTIN_MODELS if not n.startswith("gpt2")])
def test_approx_params_matches_the_built_model(name: str) -> None:
    built = build_model(name, vocab_size=256, seq_len=32)
    _, cfg = registry._build_builtin(name, {}, 256, 32)
    assert abs(approx_params(cfg) - count_params(built.module)) / count_params(built.module) < 0.02


@pytest.mark.parametrize("name", ["gpt-nano", "llama-mini", "mlp", "cnn-bn"])
def test_forward_shape_and_causality(name: str) -> None:
    torch.manual_seed(0)
    module = build_model(name, vocab_size=256, seq_len=16).module.eval()  # eval: BatchNorm uses running stats
    x = torch.randint(0, 256, (2, 16))
    logits = module(x)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    logits2 = module(x2)
    # positions before the change see the same tokens: identical logits; the changed position differs
    torch.testing.assert_close(logits[:, :10], logits2[:, :10], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 10], logits2[:, 10])


@needs_hf
def test_gpt_equals_hf_gpt2_with_the_same_weights() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    args = {"n_layer": "2", "n_head": "2", "n_embd": "32", "block_size": "64"}
    ours = build_model("gpt-nano", args, vocab_size=256, seq_len=16).module.eval()
    cfg = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, activation_function="gelu"
    )
    hf = GPT2LMHeadModel(cfg).eval()
    hf_state = hf.state_dict()
    for k, v in ours.state_dict().items():
        w = v
        # HF's Conv1D stores (in, out): the transpose of nn.Linear's weight
        if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            w = v.t()
        hf_state[k].copy_(w)
    hf.load_state_dict(hf_state)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-5, atol=1e-5)


@needs_hf
def test_llama_equals_hf_llama_with_the_same_weights() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    args = {"n_layer": "2", "n_head": "4", "n_embd": "64", "intermediate_size": "96"}
    ours = build_model("llama-mini", args, vocab_size=256, seq_len=16).module.eval()
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    hf = LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-4, atol=1e-5)


def test_model_args_are_applied_and_checked() -> None:
    built = build_model("gpt-nano", {"n_layer": "2", "bias": "false"}, vocab_size=256, seq_len=16)
    assert len(built.module.transformer.h) == 2
    assert built.module.lm_head.bias is None and built.module.transformer.h[0].attn.c_attn.bias is None
    with pytest.raises(UserError, match=r"no such setting \(did you mean n_layer\?\)"):
        build_model("gpt-nano", {"n_lyer": "2"}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match=r"no such setting; known") as e:  # nothing close: no guess
        build_model("gpt-nano", {"depth": "2"}, vocab_size=256, seq_len=16)
    assert "did you mean" not in str(e.value)
    with pytest.raises(UserError, match=r"unknown model 'gpt-nan' \(did you mean gpt-nano\?\)"):
        build_model("gpt-nan", {}, vocab_size=256, seq_len=16)
    # a Hugging Face model type without its prefix, answered without importing transformers
    with pytest.raises(UserError, match=r"unknown model 'gpt2' \(did you mean gpt2-small or hf:gpt2\?\)"):
        build_model("gpt2", {}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match=r"unknown model 'Mistral' \(did you mean hf:mistral\?\)"):
        build_model("Mistral", {}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="an integer"):
        build_model("gpt-nano", {"n_layer": "2.5"}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="multiple of n_head"):
        build_model("gpt-nano", {"n_head": "5"}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="block_size"):
        build_model("gpt-nano", {"block_size": "8"}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="vocab_size=256"):
        build_model("mlp", {"vocab_size": "100"}, vocab_size=256, seq_len=16)


def test_parse_model_args() -> None:
    assert parse_model_args(["n_layer=2", " lr = 1e-3 ", "name=a=b"]) == {
        "n_layer": "2",
        "lr": "1e-3",
        "name": "a=b",
    }
    for bad in ("n_layer", "=2", "2x=1"):
        with pytest.raises(UserError, match="KEY=VALUE"):
            parse_model_args([bad])
    assert models.coerce_value("3") == 3 and models.coerce_value("0.5") == 0.5
    assert models.coerce_value("True") is True and models.coerce_value("none") is None
    assert models.coerce_value("gelu") == "gelu"
    # a numpy scalar from a config (tester t6: TrainConfig(model_args={"n_layer": np.int64(1)}) was refused as
    # "--model-arg n_layer=1: gpt-nano expects an integer")
    import numpy as np

    assert type(models.coerce_value(np.int64(1))) is int and models.coerce_value(np.float32(0.5)) == 0.5
    model = build_model("gpt-nano", vocab_size=256, seq_len=16, model_args={"n_layer": np.int64(1)})
    assert sum(1 for m in model.module.modules() if type(m).__name__ == "GPTBlock") == 1


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(UserError) as e:
        build_model("gpt-9000", vocab_size=256, seq_len=16)
    for name in BUILTIN_MODELS:
        assert name in str(e.value)
    assert "hf:" in str(e.value) and "\n" not in str(e.value)


def test_too_big_for_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_available_ram", lambda: 2**30)
    with pytest.raises(UserError, match="GiB"):
        build_model("gpt2-medium", vocab_size=256, seq_len=16)


@needs_hf
def test_hf_model_from_config() -> None:
    args = {"n_layer": "1", "n_embd": "32", "n_head": "2", "vocab_size": "256", "n_positions": "32"}
    built = build_model("hf:gpt2", args, vocab_size=256, seq_len=16)
    assert built.kind == "hf" and built.vocab_size == 256 and built.max_seq_len == 32
    assert built.module.config.n_layer == 1
    out = built.module(torch.randint(0, 256, (1, 8)))
    assert out.logits.shape == (1, 8, 256)
    info = built.info()
    assert info["class"].endswith("GPT2LMHeadModel") and info["hidden_size"] == 32
    with pytest.raises(UserError, match=r"no field 'n_lyer' \(did you mean n_layer\?\)"):
        build_model("hf:gpt2", {"n_lyer": "1"}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="unknown Hugging Face model type"):
        build_model("hf:not-a-model", {}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match=r"model type 'lama' \(did you mean llama\?\)"):
        build_model("hf:lama", {}, vocab_size=256, seq_len=16)
    # an encoder-decoder has no causal LM: said, with where to profile it (was "Unrecognized configuration class")
    with pytest.raises(
        UserError, match=r"hf:t5 \(T5Config\) is not a causal language model.*precprof\.Profiler"
    ):
        build_model("hf:t5", {}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="positions"):
        build_model("hf:gpt2", args, vocab_size=256, seq_len=64)
    with pytest.raises(UserError, match="vocabulary"):
        build_model("hf:gpt2", {**args, "vocab_size": "100"}, vocab_size=256, seq_len=16)


@needs_hf
def test_hf_config_arguments_held_under_a_private_name_are_accepted() -> None:
    """``experts_implementation`` (the experts_fp32 finding's remedy) and ``attn_implementation`` are config
    arguments transformers keeps as ``_experts_implementation`` / ``_attn_implementation``: -a refused them as
    no field of the config. They reach the built model, as transformers' own config argument does."""
    from transformers import AutoConfig

    args = {
        "hidden_size": "32",
        "num_hidden_layers": "1",
        "num_attention_heads": "4",
        "num_key_value_heads": "2",
        "intermediate_size": "64",
        "moe_intermediate_size": "32",
        "shared_expert_intermediate_size": "64",
        "num_experts": "4",
        "vocab_size": "256",
    }
    own = AutoConfig.for_model("qwen2_moe", experts_implementation="batched_mm", attn_implementation="eager")
    built = build_model(
        "hf:qwen2_moe",
        {**args, "experts_implementation": "batched_mm", "attn_implementation": "eager"},
        vocab_size=256,
        seq_len=16,
    )
    config = built.module.config
    assert (
        (config._experts_implementation, config._attn_implementation)
        == (
            own._experts_implementation,
            own._attn_implementation,
        )
        == ("batched_mm", "eager")
    )
    with pytest.raises(UserError, match="no field 'experts_implementatoin'"):
        build_model("hf:qwen2_moe", {**args, "experts_implementatoin": "eager"}, vocab_size=256, seq_len=16)


@needs_hf
def test_an_encoder_s_causal_lm_head_that_sees_ahead_is_refused() -> None:
    """``hf:bert`` builds BertLMHeadModel, which attends both ways unless its config says is_decoder: trained on
    next tokens it read the answer (its loss fell below the data's entropy floor). Refused, with the fix; with
    it, the model is causal and trains."""
    from transformers import BertConfig, BertLMHeadModel

    from precprof.models.hf import _sees_ahead

    args = {
        "num_hidden_layers": "1",
        "hidden_size": "32",
        "num_attention_heads": "2",
        "intermediate_size": "64",
    }
    # independently: the first positions' logits move when only the last token changes
    torch.manual_seed(0)
    bert = BertLMHeadModel(BertConfig(vocab_size=256, **{k: int(v) for k, v in args.items()})).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a, b = bert(input_ids=ids).logits[:, :3], bert(input_ids=torch.tensor([[5, 6, 7, 9]])).logits[:, :3]
    assert (a - b).abs().max() > 1e-4
    with pytest.raises(
        UserError, match=r"BertLMHeadModel, which attends to later tokens \(-a is_decoder=true"
    ):
        build_model("hf:bert", args, vocab_size=256, seq_len=16)
    built = build_model("hf:bert", {**args, "is_decoder": "true"}, vocab_size=256, seq_len=16)
    rng = torch.get_rng_state()
    assert not _sees_ahead(built.module, 256) and _sees_ahead(bert.train(), 256)
    # the probe leaves the mode and the RNG as they were
    assert built.module.training and torch.equal(torch.get_rng_state(), rng)


# a one-layer decoder config of a 256-token vocabulary (transformers' field names), for the config tests
_ONE_LAYER = {"num_hidden_layers": "1", "intermediate_size": "64", "vocab_size": "256"}


@needs_hf
def test_a_hf_config_whose_heads_do_not_divide_is_one_line_naming_the_setting_to_add() -> None:
    """hf:qwen2 with -a num_attention_heads=4 keeps its config's 32 key-value heads: transformers builds the model
    and its first forward pass fails on the heads' shapes, which ``precprof train`` printed as a 60-line traceback
    from inside the training's first step (the run saved as failed). Now one line before training, naming
    transformers' line and the setting to add; with it, the model builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from precprof.errors import ModelError

    args = {**_ONE_LAYER, "hidden_size": "64", "num_attention_heads": "4"}
    # independently: the model builds, and its forward pass fails
    config = AutoConfig.for_model("qwen2", **{k: int(v) for k, v in args.items()})
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 32)
    with pytest.raises(RuntimeError):
        AutoModelForCausalLM.from_config(config)(input_ids=torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ModelError) as told:
        build_model("hf:qwen2", args, vocab_size=256, seq_len=16)
    line = str(told.value)
    assert isinstance(told.value.__cause__, RuntimeError) and "\n" not in line
    assert re.fullmatch(
        r"hf:qwen2 as configured fails its forward pass, RuntimeError at modeling_qwen2\.py:\d+: .+; "
        r"num_attention_heads=4 is not a multiple of num_key_value_heads=32, the config's default: "
        r"add -a num_key_value_heads=4 \(or a divisor of 4\)",
        line,
    ), line
    with pytest.raises(ModelError, match=r"num_key_value_heads=3: add -a num_key_value_heads=4"):
        build_model("hf:qwen2", {**args, "num_key_value_heads": "3"}, vocab_size=256, seq_len=16)
    built = build_model("hf:qwen2", {**args, "num_key_value_heads": "2"}, vocab_size=256, seq_len=16)
    assert built.module.config.num_key_value_heads == 2


@needs_hf
def test_a_hf_config_that_fails_its_forward_otherwise_names_the_settings_to_check() -> None:
    """Mixtral routing each token to 4 of its 2 experts builds, and fails top-k in its first forward pass: the
    one line names transformers' line and the settings given, to check against the defaults they leave."""
    from precprof.errors import ModelError

    args = {**_ONE_LAYER, "hidden_size": "32", "num_attention_heads": "2", "num_key_value_heads": "2"}
    args |= {"num_local_experts": "2", "num_experts_per_tok": "4"}
    with pytest.raises(ModelError) as told:
        build_model("hf:mixtral", args, vocab_size=256, seq_len=16)
    line = str(told.value)
    assert line.startswith(
        "hf:mixtral as configured fails its forward pass, RuntimeError at modeling_mixtral.py:"
    )
    assert "num_local_experts=2, num_experts_per_tok=4)" in line and "MixtralConfig" in line, line
    assert build_model("hf:mixtral", {**args, "num_experts_per_tok": "2"}, vocab_size=256, seq_len=16).module


@needs_hf
def test_a_hf_config_its_validator_refuses_is_one_line_with_the_reason() -> None:
    """transformers 5's configs are strict dataclasses: an odd RoPE head_dim raised huggingface_hub's
    StrictDataclassClassValidationError, which ``precprof train`` printed as a traceback; now one line, with
    the validator's reason rather than its name."""
    args = {**_ONE_LAYER, "hidden_size": "60", "num_attention_heads": "4", "num_key_value_heads": "4"}
    args["head_dim"] = "15"
    with pytest.raises(UserError) as told:
        build_model("hf:llama", args, vocab_size=256, seq_len=16)
    line = str(told.value)
    assert line.startswith("cannot build hf:llama from its config: ") and "head_dim" in line, line
    assert "validator" not in line and "\n" not in line


class _Seen(logging.Handler):
    """The messages of the records a logger's handlers get (after the handlers' filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@needs_hf
def test_an_encoder_head_refused_says_it_in_precprofs_one_line_only() -> None:
    """Tester t4: ``precprof train -m hf:bert`` without is_decoder printed transformers' "If you want to use
    `BertLMHeadModel` as a standalone, add `is_decoder=True.`" twice (the size check's build, then the model's)
    before precprof's own line, which says it with the option to pass. Only precprof's line now, whatever handler
    shows transformers' lines; the filter is gone after the build (the line shows where the user builds the
    model)."""
    from transformers import BertConfig, BertLMHeadModel

    from precprof.models.hf import SAID_BY_PRECPROF

    args = {
        "num_hidden_layers": "1",
        "hidden_size": "32",
        "num_attention_heads": "2",
        "intermediate_size": "64",
    }
    seen, hf_root = _Seen(), logging.getLogger("transformers")
    hf_root.addHandler(seen)
    try:
        with pytest.raises(UserError, match=r"-a is_decoder=true makes it causal"):
            build_model("hf:bert", args, vocab_size=256, seq_len=16)
        assert not [line for line in seen.lines if SAID_BY_PRECPROF in line], seen.lines
        BertLMHeadModel(BertConfig(vocab_size=256, **{k: int(v) for k, v in args.items()}))  # the user's own
        assert [line for line in seen.lines if SAID_BY_PRECPROF in line], seen.lines
    finally:
        hf_root.removeHandler(seen)


@needs_hf
def test_special_token_ids_outside_a_small_vocabulary_are_not_said_while_precprof_builds() -> None:
    """``-a vocab_size=256`` on hf:gpt2 printed transformers' "Model config: bos_token_id must be `None` or an
    integer within the vocabulary (between 0 and 255), got 50256. This may result in unexpected behavior." and the
    same of eos_token_id before the run (starcoder2 printed both with its own defaults): the built-in loop feeds
    the data's tokens and generates nothing, so they are not about the run. Dropped while precprof builds; a line
    the user's code logs after it shows."""
    from precprof.models.hf import SPECIAL_TOKEN_ID_OUTSIDE

    class Logged(logging.Filter):  # what the config's logger logs, before any handler's filter
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def filter(self, record: logging.LogRecord) -> bool:
            self.lines.append(record.getMessage())
            return True

    seen, hf_root = _Seen(), logging.getLogger("transformers")
    logged, config_logger = Logged(), logging.getLogger("transformers.configuration_utils")
    hf_root.addHandler(seen)
    config_logger.addFilter(logged)
    # transformers logs it once a process (``warning_once``, a cache of its messages): an earlier build in this
    # worker would have left nothing to drop
    once = getattr(logging.Logger, "warning_once", None)
    if once is not None and hasattr(once, "cache_clear"):
        once.cache_clear()
    try:
        args = {"n_layer": "1", "n_embd": "32", "n_head": "2", "vocab_size": "256"}
        built = build_model("hf:gpt2", args, vocab_size=256, seq_len=16)
        config = built.module.config
        assert config.bos_token_id == config.eos_token_id == 50256  # the config as transformers made it
        # logged (bos and eos, as transformers validates a config), and not shown
        assert len([line for line in logged.lines if SPECIAL_TOKEN_ID_OUTSIDE in line]) >= 2, logged.lines
        assert not [line for line in seen.lines if SPECIAL_TOKEN_ID_OUTSIDE in line], seen.lines
        said = f"Model config: bos{SPECIAL_TOKEN_ID_OUTSIDE} (between 0 and 255), got 50256."
        hf_root.warning(said)  # the user's own, after the build
        assert said in seen.lines, seen.lines
    finally:
        hf_root.removeHandler(seen)
        config_logger.removeFilter(logged)


@needs_hf
def test_a_hf_model_too_big_is_told_sizes_that_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """hf:llama's default config is 7B parameters: the refusal gives --model-arg settings, and the model they
    name builds, with the parameter count the message gives."""
    monkeypatch.setattr(base, "_available_ram", lambda: 2**31)
    with pytest.raises(UserError) as e:
        build_model("hf:llama", vocab_size=256, seq_len=16)
    message = str(e.value)
    assert (
        "\n" not in message and "pass smaller sizes with --model-arg, e.g. -a num_hidden_layers=2" in message
    )
    args = dict(a.split("=") for a in re.findall(r"-a (\S+=\S+)", message))
    assert set(args) >= {"num_hidden_layers", "hidden_size", "num_attention_heads"}
    built = build_model("hf:llama", args, vocab_size=256, seq_len=16)
    n = sum(p.numel() for p in built.module.parameters())
    assert f"({n / 1e6:,.1f}M parameters)" in message


@needs_hf
def test_an_hf_build_prints_nothing_of_the_libraries_it_imports() -> None:
    """transformers' modeling code imports torchao, whose import logged 'Failed to load .../torchao/_C_mxfp8...so'
    for each extension this torch cannot load, and torch's pytree deprecation of two of torchao's enums: lines
    about the libraries on the console of every ``--model hf:`` run. They are dropped while precprof builds the
    model; the same loggers' lines after it, and the user's warnings, show as before (a fresh process: the
    import happens once)."""
    script = textwrap.dedent(
        """
        import logging, warnings
        from precprof.models import build_model
        names = ("torchao", "torch.utils._pytree")
        levels = [logging.getLogger(n).level for n in names]
        args = {"hidden_size": "32", "num_hidden_layers": "1", "num_attention_heads": "2", "intermediate_size": "32"}
        build_model("hf:llama", {**args, "vocab_size": "256"}, vocab_size=256, seq_len=8)
        assert [logging.getLogger(n).level for n in names] == levels
        for n in names:
            logging.getLogger(n).warning("the user's line of %s", n)
        warnings.warn("the user's warning")
        """
    )
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "the user's line of torchao" in lines and "UserWarning: the user's warning" in proc.stderr
    assert any(ln.endswith("the user's line of torch.utils._pytree") for ln in lines), lines
    said = [ln for ln in lines if "the user's" not in ln and not ln.startswith("  warnings.warn")]
    assert said == [], said


def test_quiet_imports_drops_only_the_libraries_lines_and_only_inside() -> None:
    """Inside the block a torchao (or child) and a pytree warning are dropped, an error is not, nor another
    logger's warning; after it each logger has the level it had (a user's DEBUG on torchao stays)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(f"{record.name}: {record.getMessage()}")

    names = ("torchao", "torch.utils._pytree", "transformers")
    loggers = [logging.getLogger(n) for n in names]
    before = [(lg.level, lg.handlers[:]) for lg in loggers]
    keep = Keep()
    try:
        loggers[0].setLevel(logging.DEBUG)  # the user's own setting
        for lg in loggers:
            lg.addHandler(keep)
        with _quiet_imports.quiet_imports():
            for lg in loggers:
                lg.warning("inside")
            logging.getLogger("torchao.float8").warning("inside")
            loggers[0].error("an error inside")
        assert seen == ["transformers: inside", "torchao: an error inside"]
        assert [lg.level for lg in loggers] == [logging.DEBUG, before[1][0], before[2][0]]
        for lg in loggers:
            lg.warning("after")
        assert seen[2:] == [f"{n}: after" for n in names]
    finally:
        for lg, (level, handlers) in zip(loggers, before, strict=True):
            lg.setLevel(level)
            lg.handlers[:] = handlers


def test_hf_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(MissingDependencyError, match=r"pip install transformers .*\.\[hf\]"):
        build_model("hf:gpt2", vocab_size=256, seq_len=16)


@pytest.mark.parametrize(
    ("module", "missing"),
    [("precprof.integrations.hf", "transformers"), ("precprof.integrations.lightning", "lightning")],
)
def test_a_missing_integration_is_caught_by_except_import_error(
    monkeypatch: pytest.MonkeyPatch, module: str, missing: str
) -> None:
    """``try: from precprof.integrations.lightning import PrecprofCallback`` / ``except ImportError:`` (the usual
    optional import) did not catch precprof's error where lightning is not installed: a UserError only, it
    crashed the user's script. It is an ImportError too, naming the package and both ways to install it."""
    for name in ("transformers", "lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as caught:
        importlib.import_module(module)
    assert isinstance(caught.value, MissingDependencyError) and isinstance(caught.value, UserError)
    assert caught.value.name == missing
    assert f"pip install {missing} " in str(caught.value)
    assert "pip install 'precprof[" in str(caught.value) and "pip install -e '.[" in str(caught.value)


FACTORY_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self, vocab_size, width):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, width)
            self.out = nn.Linear(width, vocab_size)

        def forward(self, x):
            return self.out(self.emb(x))

    def make(vocab_size, seq_len, width=8):
        assert seq_len > 0
        return Tiny(vocab_size, width)

    def broken(**kwargs):
        raise ValueError("no GPU in this factory")

    def not_a_module():
        return 42
    """
)


@pytest.fixture()
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "usermodel.py"
    path.write_text(FACTORY_SOURCE)
    return path


def test_file_factory(factory_file: Path) -> None:
    built = build_model(f"{factory_file}:make", {"width": "12"}, vocab_size=256, seq_len=16)
    assert built.kind == "factory" and built.vocab_size == 256
    assert built.module.emb.embedding_dim == 12
    assert not built.pass_targets


def test_module_factory(factory_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(factory_file.parent))
    built = build_model("usermodel:make", {}, vocab_size=256, seq_len=16)
    assert built.module.emb.embedding_dim == 8


def test_factory_errors(factory_file: Path) -> None:
    with pytest.raises(UserError, match="raised ValueError: no GPU in this factory"):
        build_model(f"{factory_file}:broken", vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match=r"not a torch\.nn\.Module"):
        build_model(f"{factory_file}:not_a_module", vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="no callable"):
        build_model(f"{factory_file}:missing", vocab_size=256, seq_len=16)
    # an argument the factory has no parameter of: its parameters, and the closest one (Python's "got an
    # unexpected keyword argument 'widht'" named neither)
    with pytest.raises(
        UserError, match=r"has no parameter depth; its parameters: vocab_size, seq_len, width$"
    ):
        build_model(f"{factory_file}:make", {"depth": "3"}, vocab_size=256, seq_len=16)
    with pytest.raises(
        UserError, match=r"no parameter widht \(did you mean width\?\); its parameters: vocab"
    ):
        build_model(f"{factory_file}:make", {"widht": "3"}, vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="no such file"):
        build_model(f"{factory_file.parent / 'nope.py'}:make", vocab_size=256, seq_len=16)
    with pytest.raises(UserError, match="cannot import"):
        build_model("no_such_package_xyz.mod:make", vocab_size=256, seq_len=16)
    bad = factory_file.parent / "bad.py"
    bad.write_text("raise RuntimeError('import-time failure')\n")
    with pytest.raises(UserError, match="import-time failure"):
        build_model(f"{bad}:make", vocab_size=256, seq_len=16)


@needs_hf
def test_a_config_whose_pad_token_is_outside_the_vocabulary_is_one_line() -> None:
    """hf:phi3 keeps its pad_token_id 32000 when --model-arg vocab_size=256 shrinks the vocabulary: building it
    raised an AssertionError from the embedding, a traceback. One line now, with the setting that fixes it."""
    args = {"num_hidden_layers": "1", "hidden_size": "64", "num_attention_heads": "4", "vocab_size": "256"}
    args |= {"num_key_value_heads": "4", "intermediate_size": "128"}
    with pytest.raises(
        UserError, match=r"pad_token_id 32000 is outside the vocabulary: set -a pad_token_id=0"
    ):
        build_model("hf:phi3", args, vocab_size=256, seq_len=16)
    assert build_model("hf:phi3", {**args, "pad_token_id": "0"}, vocab_size=256, seq_len=16).vocab_size == 256
