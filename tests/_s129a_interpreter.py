"""Triton's interpreter without its repeated patching of ``triton.language`` inside a kernel.

A launch in the interpreter (``GridExecutor.__call__``) replaces ``triton.language``'s builtins with the
interpreter's for the launch and puts them back after it. Every call of a nested ``@triton.jit`` function inside
the kernel then patches them again (``_patch_lang`` at the top of ``InterpretedFunction.__call__``: an
``inspect.getmembers`` walk of ``tl``, ``tl.tensor``, ``tl.math`` and ``tl.core``'s tensor-descriptor class),
although the launch has patched them already: the walk finds no builtin left to replace, and what it sets again
are the same closures anew. precprof's block kernel calls its helpers a few hundred times a program: in the
interpreter that walk was about a third of a launch's CPU time (test_triton_block's accumulator test: 8.6 of
25.7 profiled seconds).

``skip_nested_patching`` (a fixture's context) makes such a nested ``_patch_lang`` return at once while the
launch has patched, itself or through an earlier nested call, the very modules the nested function sees; the first
function in a launch to see another of them (``tl.sum``'s module sees ``tl.core`` where the kernel saw ``tl``
only) is patched as before. What the kernel computes is unchanged: the same interpreter
functions run. Where Triton's interpreter is not as described (another version), nothing is changed."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def skip_nested_patching() -> Iterator[None]:
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    grid = getattr(interpreter, "GridExecutor", None)
    real_patch = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    tl = getattr(interpreter, "tl", None)
    if grid is None or real_patch is None or scope_cls is None or tl is None:
        yield
        return
    try:
        params = list(inspect.signature(real_patch).parameters)
    except (TypeError, ValueError):
        params = []
    if params != ["fn"]:
        yield
        return
    # per launch in progress (a stack): the language modules it patched, once its own patch is done
    active: list[set[int] | None] = []

    def langs_of(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn: Any) -> Any:
        if not active:
            return real_patch(fn)
        patched = active[-1]
        if patched is None:  # the launch's own patch (the first in it)
            active[-1] = langs_of(fn)
            return real_patch(fn)
        langs = langs_of(fn)
        if langs <= patched:
            return scope_cls()  # (an empty scope: restoring it changes nothing)
        patched |= langs  # (triton.language.standard's functions see tl.core: patched once a launch too)
        return real_patch(fn)

    real_call = grid.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        active.append(None)
        try:
            return real_call(self, *args, **kwargs)
        finally:
            active.pop()

    interpreter._patch_lang = patch_lang
    grid.__call__ = call
    try:
        yield
    finally:
        grid.__call__ = real_call
        interpreter._patch_lang = real_patch
