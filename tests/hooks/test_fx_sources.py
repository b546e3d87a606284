"""hooks.fx_sources: a recompiled graph module's source leaves torch's caches
when its code is freed, and only then; the code is the same."""

from __future__ import annotations

import gc
import linecache

import torch
import torch.fx.graph_module as fx_graph_module

from ptdstream.hooks.fx_sources import GENERATED_PREFIX, releasing_generated_sources

UPSTREAM = fx_graph_module._method_from_src


class _Add(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _key(gm) -> str:
    return type(gm).forward.__code__.co_filename


def test_sources_of_freed_code_leave_the_caches_and_live_code_keeps_its_source():
    cache = fx_graph_module._loader.eval_cache
    with releasing_generated_sources():
        assert fx_graph_module._method_from_src is not UPSTREAM
        gm = torch.fx.symbolic_trace(_Add())
        first = _key(gm)
        assert first.startswith(GENERATED_PREFIX) and first in cache
        gm.recompile()  # the old forward is replaced, so freed
        second = _key(gm)
        assert second != first and second in cache
        assert first not in cache and first not in linecache.cache
        # live code keeps its source for tracebacks
        assert "relu" in linecache.getline(second, type(gm).forward.__code__.co_firstlineno + 1) + "".join(
            linecache.getlines(second))
        assert torch.equal(gm(torch.tensor([-1.0, 2.0])), torch.tensor([1.0, 3.0]))
        del gm
        gc.collect()  # a graph module's class is freed by the collector
        assert second not in cache and second not in linecache.cache
    assert fx_graph_module._method_from_src is UPSTREAM


def test_outside_the_context_and_for_named_code_sources_stay_as_upstream_keeps_them():
    cache = fx_graph_module._loader.eval_cache
    gm = torch.fx.symbolic_trace(_Add())
    key = _key(gm)
    del gm
    gc.collect()
    assert key in cache  # upstream's behaviour: kept for the process
    with releasing_generated_sources():
        fn = fx_graph_module._forward_from_src("def forward(self):\n    return 1\n", {},
                                               {"co_filename": "my_module.py"})
        assert fn.__code__.co_filename == "my_module.py"
        del fn
        gc.collect()
        assert "my_module.py" in cache  # a name given through co_fields may be shared: left alone
    cache.pop("my_module.py", None)
    cache.pop(key, None)


def test_dynamo_imported_or_converting_inside_leaves_its_own_name_alone():
    import torch._dynamo.convert_frame as convert_frame

    before = fx_graph_module._forward_from_src, convert_frame.original_forward_from_src
    with releasing_generated_sources():
        fn = torch.compile(lambda x: torch.relu(x) + 1, backend="eager")
        assert torch.equal(fn(torch.tensor([-1.0, 2.0])), torch.tensor([1.0, 3.0]))
        assert fx_graph_module._forward_from_src is before[0]  # the name dynamo swaps is not the one patched
    assert (fx_graph_module._forward_from_src, convert_frame.original_forward_from_src) == before
    assert fx_graph_module._method_from_src is UPSTREAM
