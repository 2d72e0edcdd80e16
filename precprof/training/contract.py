"""The user's own model (``--model file.py:factory``) against the batch contract, checked before training.

The memory estimate runs the forward pass and the loss first (``precprof.footprint``), and keeps going when they
raise: the estimate is left unmeasured. For a factory's model that failure is the user's to fix, and met there
it costs nothing to say: ``check_forward`` runs the failed pass once more without the measuring (which alone
can fail where training would not: a forward under ``torch.func`` refuses the estimate's saved-tensor hooks) and
refuses the run in one line, before its run directory is made. It named nothing but a 40-line traceback after a
run directory whose report showed a run that never took a step. A built-in model failing so is refused in one
line too where the failure is the sizes' (it runs at a larger batch: cnn-bn's BatchNorm1d at batch 1 x seq 1),
and left to training, with its traceback, where it is not (precprof's own bug).

``no_gradient`` says what is wrong with an output the loss takes no gradient from (integer logits, a detached
loss): torch's backward said "element 0 of tensors does not require grad and does not have a grad_fn" at step 0.

``sparse_gradients`` refuses sparse gradients the run's optimizer cannot take: AdamW's, or SGD's with weight
decay. The loop crashed on them at step 0 in its gradient norm, even with clipping off and an optimizer that
takes them, in a traceback said to be "a bug in precprof's own code".

``complex_parameters`` refuses a complex parameter the precision cannot train: under loss scaling torch's
GradScaler cannot unscale its gradient (a traceback after step 0, also said to be precprof's bug), and a pure
mode's cast to 16 bits kept its real part alone, without a word.

``layout_note`` is the one thing the contract cannot check: logits whose last two dimensions are equal.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from precprof import footprint
from precprof.errors import ModelError, UserError
from precprof.models import BuiltModel
from precprof.models.factory import where_raised
from precprof.modes import FP16_MODES, PURE_MODES, OptimizerName


def check_forward(
    built: BuiltModel,
    model: nn.Module,
    forward_loss: Callable[[int], torch.Tensor],
    failed_at: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
) -> None:
    """UserError, one line, when the memory estimate's pass failed (``failed_at``: its batch, 0 for none) and a
    factory's or built-in model fails the forward pass and loss again as training runs them: in training mode
    at the run's ``batch_size``, without the measuring (a model whose state is sized for the training batch, an
    LSTM's initial hidden state, fails at the estimate's batch 1 and trains). The model's exception is the
    error's cause (a traceback for a caller of ``precprof.training.train``). A built-in model is refused only
    where the pass runs at ``batch_size + 1`` (``size_failed``): a failure at every size is precprof's bug,
    which keeps its traceback in training. An out-of-memory error, a Hugging Face model (its failure is the
    library's), and a pass that succeeds are left to training. Nothing runs where the estimate's passes ran
    (``failed_at`` 0): no run pays for it but one that failed them."""
    if not failed_at or built.kind not in ("factory", "builtin"):
        return
    try:
        _run_quietly(model, forward_loss, batch_size)
    except UserError:
        raise  # the loop's own reading of the output: one line already, naming the fix
    except torch.OutOfMemoryError:
        return
    except Exception as e:
        if built.kind == "factory":
            raise forward_failed(built, e, (batch_size, seq_len), vocab_size) from e
        try:
            _run_quietly(model, forward_loss, batch_size + 1)
        except Exception:
            return  # no size's fault: left to training, where the bug keeps its traceback
        raise size_failed(built, model, e, batch_size, seq_len) from e


def _run_quietly(model: nn.Module, forward_loss: Callable[[int], torch.Tensor], batch_size: int) -> None:
    """``footprint.run_once`` of the pass at ``batch_size``, its warnings hidden (the estimate's pass has shown
    the model's warnings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        footprint.run_once(model, lambda: forward_loss(batch_size))


# BatchNorm in training mode refuses a batch of one value per channel
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def size_failed(
    built: BuiltModel, model: nn.Module, e: BaseException, batch_size: int, seq_len: int
) -> UserError:
    """The one-line error for a built-in model whose forward pass raised ``e`` at ``batch_size`` x ``seq_len``
    and runs at a larger batch: the sizes, the exception, and the fix. A BatchNorm layer in training mode needs
    more than one value per channel, batch_size x seq_len of them for cnn-bn's BatchNorm1d (batch, channels,
    seq): either size at 2 does; any other failure is told the larger batch it ran at."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    head = (
        f"{built.name} cannot train at --batch-size {batch_size} x --seq-len {seq_len}: its forward pass raised "
        f"{type(e).__name__}: {first}"
    )
    norms = [m for m in model.modules() if isinstance(m, _BATCH_NORMS)]
    if norms and batch_size * seq_len < 2:
        kinds = " and ".join(sorted({type(m).__name__ for m in norms}))
        layers = (
            f"{len(norms)} {kinds} layer needs" if len(norms) == 1 else f"{len(norms)} {kinds} layers need"
        )
        return UserError(
            f"{head}; its {layers} more than one value per channel in training, batch_size x seq_len of at "
            "least 2: use --batch-size 2 or --seq-len 2"
        )
    return UserError(f"{head}; it runs at --batch-size {batch_size + 1}: use --batch-size {batch_size + 1}")


# the file of torch's module call (``model(x)`` runs forward from there)
_MODULE_FILE = inspect.getfile(nn.Module)


def raised_in_forward(e: BaseException) -> bool:
    """Whether ``e`` was raised inside the model's forward, by its own code or an op it called (torch's oneDNN has
    no fp16 LSTM on the CPU), rather than at the call or in reading what the forward returned: its traceback goes
    on past torch's module call into code that is not that call's."""
    frames = traceback.extract_tb(e.__traceback__)
    calls = [i for i, f in enumerate(frames) if f.filename == _MODULE_FILE]
    return bool(calls) and any(f.filename != _MODULE_FILE for f in frames[calls[0] + 1 :])


def forward_failed(
    built: BuiltModel, e: BaseException, shape: tuple[int, int], vocab_size: int
) -> ModelError:
    """The one-line error for a factory's model whose forward pass raised ``e`` on token ids of ``shape``: the
    exception, the place in the user's files, and what precprof train calls the model with; what it must return
    (README, "Your own model") only where the failure was not raised inside the forward (``raised_in_forward``):
    an op that fails there (an fp16 LSTM the CPU cannot run) has nothing to do with the output, which the hint
    sent the user to look at. A model with no embedding is most likely no language model: where else to profile
    it."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    call = "model(x, targets=y)" if built.pass_targets else "model(x)"
    targets = ", y the next-token ids of the same shape" if built.pass_targets else ""
    other = (
        "; precprof train trains language models: profile any other model in your own loop with precprof.Profiler"
        if not any(isinstance(m, nn.Embedding) for m in built.module.modules())
        else ""
    )
    output = (
        ""
        if raised_in_forward(e)
        else "; it must return logits (batch_size, seq_len, vocab_size), a scalar loss, or an output with .logits "
        "or .loss"
    )
    return ModelError(
        f"{built.name}: the model's forward pass raised {type(e).__name__}: {first}{where_raised(e)}, before "
        f"training, on the batch precprof train feeds it: {call} with x the token ids in [0, {vocab_size}), an "
        f"int64 tensor (batch_size, seq_len), here {shape}{targets}{output}{other}"
    )


def no_gradient(name: str, model: nn.Module, loss: torch.Tensor, logits: torch.Tensor | None) -> UserError:
    """The one-line error for a model whose output the loop's loss carries no gradient back from (``loss`` does not
    require grad while autograd is on): backward would refuse it ("element 0 of tensors does not require grad")
    at the first step, a traceback of torch's after the measuring passes ran it without a word. ``logits``: what
    the loss was taken from (``loop.logits_read``), None for a loss the model returned; ``name``: the model's.
    A ``model`` without a trainable parameter is said so (the optimizer's check, met after this pass); integer
    logits (an argmax, a ``.long()``) or loss have no gradient at all; a float one was cut off from the
    trainable parameters (detached, under ``torch.no_grad()``, remade from values, or from frozen layers alone)."""
    if not any(p.requires_grad for p in model.parameters()):
        n = sum(1 for _ in model.parameters())
        why = f"all its {n} parameter tensors have requires_grad=False" if n else "it has no parameters"
        return UserError(
            f"{name}: the model ({type(model).__name__}) has no trainable parameters ({why}): nothing to train or "
            "profile; check the factory returns the model with its layers, and does not freeze them all"
        )
    what, t = ("logits", logits) if logits is not None else ("a loss", loss)
    if not (t.is_floating_point() or t.is_complex()):
        fix = (
            "return the float scores of its output layer, before any argmax, .long() or .int()"
            if logits is not None
            else "return the loss as a float tensor computed from the logits (F.cross_entropy), or the logits alone"
        )
        return UserError(
            f"{name}: the model's forward returned {what} of dtype {str(t.dtype).removeprefix('torch.')}: an integer "
            f"tensor has no gradient to train the model with; {fix}"
        )
    do, they = ("do", "they are") if logits is not None else ("does", "it is")
    return UserError(
        f"{name}: the model's forward returned {what} that {do} not require grad: {they} not computed from its "
        "trainable parameters, so training has no gradient to take; remove the .detach(), .data, torch.no_grad() "
        "or tensor rebuilt from values (torch.tensor(...), .item(), .tolist()) on the way from the parameters to "
        "the output, and check the layers it goes through are not all frozen (requires_grad=False)"
    )


def _names(names: Sequence[str]) -> str:
    """Up to three names, then how many more."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def sparse_modules(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights of ``model``'s ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``
    layers, by name: the parameters that may get sparse gradients (not when the forward also uses the weight
    densely, a tied output head: autograd then sums into a dense gradient)."""
    return {
        f"{name}.weight" if name else "weight": m.weight
        for name, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad
    }


def sparse_gradients(
    name: str,
    model: nn.Module,
    forward_loss: Callable[[int], torch.Tensor],
    batch_size: int,
    optimizer: str,
    weight_decay: float,
    sharded: str = "",
) -> None:
    """Refuse (``refuse_sparse``) before training the sparse gradients the run's optimizer cannot take. A model
    with ``sparse_modules`` under such an optimizer is asked which of them get a sparse gradient: one forward
    pass and loss at the run's ``batch_size`` (as ``check_forward``) and their gradients
    (``torch.autograd.grad``: no ``.grad`` is set), training unchanged (``footprint.run_once``). No pass for
    any other model or for SGD without weight decay outside FSDP. Under FSDP (``sharded``: the
    ``--distributed`` strategy, fsdp1 or fsdp2) a sparse gradient is refused whatever the optimizer: it cannot be
    sharded (fsdp2's ``chunk_cat`` and fsdp1's flattening have no sparse kernel: an error in step 0's backward).
    DDP reduces it as it is."""
    params = sparse_modules(model)
    fsdp = sharded.startswith("fsdp")
    if not params or (optimizer == OptimizerName.SGD.value and not weight_decay and not fsdp):
        return
    found: list[str] = []

    def forward_backward() -> torch.Tensor:
        loss = forward_loss(batch_size)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        found.extend(n for n, g in zip(params, grads, strict=True) if g is not None and g.is_sparse)
        return loss

    footprint.run_once(model, forward_backward)
    if fsdp and found:
        raise UserError(
            f"{name}: {_names(found)} {'gets a sparse gradient' if len(found) == 1 else 'get sparse gradients'} "
            f"(sparse=True in its embedding), which --distributed {sharded} cannot shard: use --distributed ddp, "
            "or sparse=False in the model's embedding"
        )
    refuse_sparse(name, found, optimizer, weight_decay)


def refuse_sparse(name: str, sparse: Sequence[str], optimizer: str, weight_decay: float) -> None:
    """UserError, one line, when parameters with sparse gradients (``sparse``, by name: ``sparse_gradients``
    before training, the gradients of step 0 in it) meet an optimizer that cannot take them: AdamW (torch's
    and precprof's fp32-state one refuse them) or SGD with weight decay (``add(sparse, dense)`` is not
    supported). SGD without weight decay takes them; the loop's norm and clipping read them."""
    if not sparse:
        return
    what = (
        f"{name}: {_names(sparse)} {'gets a sparse gradient' if len(sparse) == 1 else 'get sparse gradients'}"
    )
    undo = "or sparse=False in the model's embedding"
    if optimizer != OptimizerName.SGD.value:
        decay = " --weight-decay 0" if weight_decay else ""
        raise UserError(
            f"{what} (sparse=True in its embedding), which --optimizer {optimizer} cannot take (torch's AdamW "
            f"refuses them): use --optimizer sgd{decay}, which takes sparse gradients, {undo}"
        )
    if weight_decay:
        raise UserError(
            f"{what} (sparse=True in its embedding), to which SGD cannot add weight decay (torch has no sparse + "
            f"dense add): use --weight-decay 0, {undo}"
        )


def complex_parameters(name: str, model: nn.Module, precision: str, loss_scaling: bool) -> None:
    """UserError, one line, for a trainable complex parameter the run cannot train: under loss scaling
    (``loss_scaling``: fp16's dynamic scaling, or any --loss-scale) torch's GradScaler cannot unscale its
    gradient (``_amp_foreach_non_finite_check_and_unscale_`` has no complex kernel: a traceback after step 0);
    in a pure mode the cast to 16 bits keeps its real part alone, without a word (torch has no complex bf16,
    and the fp32-state optimizers work in real fp32). fp32 and bf16 autocast train it, its tensors skipped by
    the profiler as README says."""
    real = (
        "or hold the parameter as a real tensor, torch.view_as_real(...), and take torch.view_as_complex of it "
        "in forward"
    )
    if precision in PURE_MODES:
        # the pure cast (``model.to``) takes every parameter and buffer, a frozen one and a RoPE table's too
        held = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_complex()]
        if held:
            raise UserError(
                f"{_complex_said(name, held)}, and --precision {precision} casts every parameter and buffer to "
                f"{precision.removesuffix('-pure')}, which would drop its imaginary part: use --precision bf16 "
                f"(autocast) or fp32, {real}"
            )
    found = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_complex()]
    if not found:
        return
    what = _complex_said(name, found)
    if loss_scaling:
        fix = "--precision bf16 or fp32 (no loss scaling)" if precision in FP16_MODES else "--loss-scale none"
        raise UserError(
            f"{what}, and torch's GradScaler cannot unscale complex gradients (loss scaling, --precision "
            f"{precision}): use {fix}, {real}"
        )


def _complex_said(name: str, found: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The complex tensors ``found`` (by name) of the model ``name``, in words: "name: a.w is complex64"."""
    dtype = str(found[0][1].dtype).removeprefix("torch.")
    return f"{name}: {_names([n for n, _ in found])} {'is' if len(found) == 1 else 'are'} {dtype}"


def layout_note(built: BuiltModel, logits_shape: Sequence[int] | None) -> str:
    """A line for the terminal when a factory's model returned logits whose last two dimensions are equal
    ("" otherwise): (batch, seq_len, vocab) and a conv head's (batch, vocab, seq_len) then look alike, and the
    loop reads the latter as the former without a word (trains the wrong loss), where any other --seq-len
    refuses it. A note, not a refusal: a model that returns (batch, seq_len, vocab) at a --seq-len equal to its
    vocabulary (256, the data's) is right, and must still train."""
    if built.kind != "factory" or logits_shape is None or len(logits_shape) != 3:
        return ""
    if logits_shape[1] != logits_shape[2]:
        return ""
    n = logits_shape[2]
    return (
        f"{built.name} returned logits of shape (batch_size, {n}, {n}): with --seq-len equal to its {n} classes, "
        f"precprof cannot tell (batch, seq_len, vocab) from (batch, vocab, seq_len) and reads them as (batch, "
        f"seq_len, vocab); if your model returns (batch, vocab, seq_len), return logits.transpose(1, 2), and a "
        f"--seq-len other than {n} lets precprof check the layout"
    )
