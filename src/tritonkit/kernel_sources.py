"""What a tuner's source hash covers: a kernel's text, and its jit closure (the tritonkit
``@triton.jit`` helpers it calls and the constexpr globals they read), found the way Triton's own
cache key finds them, so that an edited helper retunes the kernels that call it."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap


def source_text(source) -> str:
    """The text a tuner hashes: a triton JITFunction's ``src`` (dedented, from ``def``, no decorators);
    any other function's the same way, so that the interpreter's hash equals the GPU's and a CPU run
    can tell whether configs tuned on the GPU still describe these kernels."""
    if isinstance(source, str):
        return source
    if isinstance(getattr(source, "src", None), str):  # triton JITFunction
        return source.src
    if hasattr(source, "fn"):  # the interpreter's InterpretedFunction, triton's Autotuner
        return source_text(source.fn)
    text = textwrap.dedent(inspect.getsource(source))
    start = re.search(r"^def\s+\w+\s*\(", text, re.MULTILINE)
    return text[start.start() :] if start else text


def _python_function(value):
    """The plain function behind a ``@triton.jit`` kernel or helper (compiled or interpreted), else None."""
    if type(value).__name__ not in ("JITFunction", "InterpretedFunction"):
        return None
    fn = value.fn
    return fn if inspect.isfunction(fn) and fn.__module__.startswith("tritonkit") else None


def jit_closure(kernel) -> dict[str, str]:
    """The source of ``kernel`` and of every tritonkit ``@triton.jit`` helper it calls, directly or
    through other helpers, plus the constexpr globals they read: name -> text. This is what a tuned
    kernel compiles from, found the way Triton's own cache key finds a kernel's dependencies (the
    names each body reads, looked up in its module's globals), so no list is kept by hand."""
    texts: dict[str, str] = {}
    pending = [kernel]
    while pending:
        fn = _python_function(pending.pop())
        if fn is None or f"{fn.__name__}()" in texts:
            continue
        source = source_text(fn)
        texts[f"{fn.__name__}()"] = source
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name) and node.id in fn.__globals__:
                value = fn.__globals__[node.id]
                if _python_function(value) is not None:
                    pending.append(value)
                elif type(value).__name__ == "constexpr":
                    texts[node.id] = repr(value.value)
    return texts


def hashed_texts(source) -> list[str]:
    """What a tuner hashes for one of its sources: a string as it is; a kernel with its jit closure."""
    if isinstance(source, str) or _python_function(source) is None:
        return [source_text(source)]
    return [f"{name}={text}" for name, text in sorted(jit_closure(source).items())]
