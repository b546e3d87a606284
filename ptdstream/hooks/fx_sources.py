"""The Python source of generated graph code kept only while that code lives.

Every ``GraphModule.recompile`` (``torch/fx/graph_module.py``) compiles the
graph's Python source through ``_method_from_src`` and stores the source in
the module-level ``_loader.eval_cache`` under a new ``<eval_with_key>.N``
name, plus a ``linecache`` entry holding a copy of the code's globals, so that
tracebacks can show generated lines. Neither is ever removed. An export
recompiles whole programs after most passes, and executorch's partitioning
recompiles the whole top-level graph once per partition
(``exir/lowered_backend_module.py::create_submodule_from_nodes`` ->
``legalize_graph``): for an 18-layer Llama lowered to XNNPACK, 13,000 sources
and 50 MiB stay in the process, quadratic in the layer count.

While :func:`releasing_generated_sources` is active, each method compiled
under a ``<eval_with_key>.`` name gets a finalizer: when the function is freed
(its module is gone, or recompiled), its source and its ``linecache`` entry
are removed. Code that is alive keeps its source; a traceback printed after
its module was freed shows the file name and line number without the line.
A name given as ``co_fields["co_filename"]`` alone (which several modules may
share) is left alone. ``_method_from_src`` is patched, not ``_forward_from_src``,
which dynamo swaps itself (unlocked) while it converts a frame and binds when
imported; its conversions go through the patch too. The generated code, and
so every byte written, is unchanged. The patch is scoped through
:mod:`ptdstream.upstream.patching`; the names are registered in
:mod:`ptdstream.upstream.names`.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import weakref
from collections.abc import Iterator
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed

__all__ = ["GENERATED_PREFIX", "releasing_generated_sources"]

#: the names torch's loader gives the sources it generates (``_EvalCacheLoader._get_key``)
GENERATED_PREFIX = "<eval_with_key>."


def _forget(cache: dict[str, str], key: str) -> None:
    cache.pop(key, None)
    linecache.cache.pop(key, None)


def _releasing(method_from_src, cache: dict[str, str]):
    @functools.wraps(method_from_src)
    def method_released(method_name: str, src: str, globals: dict[str, Any],
                        co_fields: dict[str, Any] | None = None):
        fn = method_from_src(method_name=method_name, src=src, globals=globals, co_fields=co_fields)
        key = getattr(getattr(fn, "__code__", None), "co_filename", "")
        if key.startswith(GENERATED_PREFIX) and cache.get(key) is src:
            weakref.finalize(fn, _forget, cache, key).atexit = False
        return fn

    return method_released


@contextlib.contextmanager
def releasing_generated_sources() -> Iterator[None]:
    """While active, the source of each graph module method compiled is
    removed from torch's caches when the function is freed. Nests; the patch is
    removed when the last context exits (finalizers already set stay)."""
    module = adapter.fx_graph_module_module()
    with shadowed(module, "_method_from_src", _releasing(module._method_from_src, module._loader.eval_cache)):
        yield
