"""The user's own model: ``path/to/file.py:factory`` or ``package.module:factory``."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from precprof.errors import ModelError, UserError, did_you_mean
from precprof.models.base import (
    BuiltModel,
    VocabGuess,
    accepts_targets,
    check_forward_contract,
    coerce_value,
    guess_vocab,
)


def _on_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _load_factory(spec: str) -> Callable[..., Any]:
    target, _, attr = spec.rpartition(":")
    if not target or not attr.isidentifier():
        raise UserError(f"--model {spec!r}: expected path/to/file.py:factory or package.module:factory")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"--model {spec!r}: no such file {str(path)!r}")
        # its folder first on the import path, as `python file.py` puts it: a model file imports its neighbours
        _on_path(str(path.resolve().parent))
        mod_name = f"precprof_user_model_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise UserError(f"--model {spec!r}: cannot import {str(path)!r} as Python")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
        try:
            file_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise ModelError(
                f"--model {spec!r}: importing {str(path)!r} failed: {type(e).__name__}: {_first(e)}"
                f"{where_raised(e)}"
            ) from e
    else:
        _on_path(str(Path.cwd()))  # as `python -m` does: a package in the current folder
        try:
            module = importlib.import_module(target)
        except Exception as e:
            said = f"--model {spec!r}: cannot import {target!r}: {type(e).__name__}: {_first(e)}"
            # no such module: a mistake in --model, no code of the user's ran
            if isinstance(e, ModuleNotFoundError) and e.name and f"{target}.".startswith(f"{e.name}."):
                raise UserError(said) from None
            raise ModelError(f"{said}{where_raised(e)}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"--model {spec!r}: {target!r} has no callable {attr!r}")
    return factory


def _build_factory(spec: str, args: Mapping[str, Any], vocab_size: int, seq_len: int) -> BuiltModel:
    factory = _load_factory(spec)
    kwargs = {k: coerce_value(v) for k, v in args.items()}
    params: Mapping[str, inspect.Parameter] | None = None
    try:
        params = inspect.signature(factory).parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for k, v in (("vocab_size", vocab_size), ("seq_len", seq_len)):
            if (k in params or var_kw) and k not in kwargs:
                kwargs[k] = v
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        pass
    _check_unknown(spec, params, args)
    _check_required(spec, params or {}, kwargs)
    try:
        module = factory(**kwargs)
    except Exception as e:  # the exception is the error's cause: its traceback (PRECPROF_TRACEBACK=1)
        raise ModelError(
            f"model factory {spec!r} raised {type(e).__name__}: {_first(e)}{where_raised(e)}"
        ) from e
    if not isinstance(module, nn.Module):
        raise UserError(f"model factory {spec!r} returned {type(module).__name__}, not a torch.nn.Module")
    check_forward_contract(module, spec)
    passed = kwargs.get("vocab_size")
    guess = guess_vocab(module, passed if isinstance(passed, int) and not isinstance(passed, bool) else None)
    # the largest of several bounds them all: refused only when no embedding can take the data's token ids
    if guess.size is not None and guess.size < vocab_size:
        given = "user" if "vocab_size" in args else "precprof" if "vocab_size" in kwargs else None
        raise _too_few_tokens(spec, guess, vocab_size, given)
    return BuiltModel(
        module=module,
        name=spec,
        kind="factory",
        # several embeddings, none known to be the tokens': the logits' classes say it once read (else unknown)
        vocab_size=guess.size if guess.sure else None,
        vocab_from_logits=not guess.sure,
        max_seq_len=None,
        pass_targets=accepts_targets(module),
    )


def _check_unknown(
    spec: str, params: Mapping[str, inspect.Parameter] | None, args: Mapping[str, Any]
) -> None:
    """UserError for a --model-arg the factory takes no parameter of, naming the closest of its parameters and
    all of them, as a built-in model's unknown setting is answered: Python's "build() got an unexpected keyword
    argument 'widht'" named neither. Nothing is checked for a factory with ``**kwargs`` or no signature (None)."""
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    known = [name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for k in args:
        if k not in known:
            raise UserError(
                f"--model-arg {k}: model factory {spec!r} has no parameter {k}{did_you_mean(k, known)}; "
                + (f"its parameters: {', '.join(known)}" if known else "it takes none")
            )


def _check_required(spec: str, params: Mapping[str, inspect.Parameter], kwargs: Mapping[str, Any]) -> None:
    """UserError naming the factory's parameters without a default that no --model-arg gives, and how to give
    them: Python's "missing 1 required positional argument" did not say that -a passes them."""
    missing = [
        name
        for name, p in params.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in kwargs
    ]
    if missing:
        raise UserError(
            f"model factory {spec!r} needs {', '.join(missing)} (no default, and no --model-arg gives "
            f"{'it' if len(missing) == 1 else 'them'}): pass " + " ".join(f"-a {m}=VALUE" for m in missing)
        )


# precprof's own files, which call the user's code: never the place of the user's error
_PRECPROF = str(Path(__file__).resolve().parent.parent) + os.sep


def is_precprof(filename: str) -> bool:
    """Whether a traceback frame's file is precprof's own."""
    return filename.startswith(_PRECPROF)


def is_users(filename: str) -> bool:
    """Whether a traceback frame's file is the user's own: of neither Python's, an installed package's nor
    precprof's."""
    return not filename.startswith(("<", _PRECPROF, *_installed()))


@functools.cache
def _installed() -> tuple[str, ...]:
    return tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def where_raised(e: BaseException) -> str:
    """Where the user's own code raised ``e``: " (at file.py:12, in build)" for the innermost frame of its
    traceback in the user's own file (``is_users``), "" when there is none. The one-line error keeps the
    failure's place, which the user needs when it lies deep inside their model's code (a factory's, or a
    forward pass's)."""
    own = [f for f in traceback.extract_tb(e.__traceback__) if is_users(f.filename)]
    if not own:
        return ""
    f = own[-1]
    return f" (at {f.filename}:{f.lineno}, in {f.name})"


def _first(e: BaseException) -> str:
    """The first line of ``e``'s message ("" for none): the one-line error keeps to one line."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _too_few_tokens(spec: str, guess: VocabGuess, vocab_size: int, given: str | None) -> UserError:
    """The error for a factory's model that embeds fewer tokens than the data has, with the fix that works for
    this factory: "--model-arg vocab_size=N" helps only a factory that takes vocab_size, and precprof already
    passes it to one that does unless the user set it (``given``: "user", "precprof" or None). A model of several
    embeddings, none known to embed the tokens (``guess.sure`` false), is refused only when its largest is too
    small, and the error names it."""
    vocab = guess.size
    which = "" if guess.sure else f" (its largest nn.Embedding, {guess.name!r}, has {vocab} rows)"
    head = f"{spec} has a vocabulary of {'at most ' if not guess.sure else ''}{vocab} tokens{which} but the data uses {vocab_size}"
    if given == "user":
        return UserError(f"{head}; use --model-arg vocab_size={vocab_size}")
    if given == "precprof":
        return UserError(
            f"{head}, although precprof passed the factory vocab_size={vocab_size}: build the model's embedding "
            "and output with the vocab_size the factory is given"
        )
    return UserError(
        f"{head}; the model must take token ids up to {vocab_size - 1} and output {vocab_size} logits: give the "
        f"factory a vocab_size parameter (precprof passes {vocab_size}), or build the model with {vocab_size}"
    )
