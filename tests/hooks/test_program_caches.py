"""hooks.program_caches: the references upstream keeps to finished programs
(dynamo's captured graphs in its module globals, ``is_same_node``'s cache,
XNNPACK's last refused node) are dropped, and only those."""

from __future__ import annotations

import gc
import weakref

import torch
import torch._dynamo.functional_export as functional_export
from executorch.backends.xnnpack.partition.config import xnnpack_config
from executorch.exir.backend import utils as backend_utils

from ptdstream.hooks.program_caches import (
    CAPTURED_PREFIX,
    capture_globals,
    counting_export,
    forget_captured_graphs,
    forget_node_caches,
)


class _Relu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x))


def _captured(before) -> list[str]:
    return [n for n in vars(functional_export) if n.startswith(CAPTURED_PREFIX) and n not in before]


def test_a_strict_export_leaves_its_captured_graph_in_dynamos_globals_upstream():
    """The leak the hook exists for (torch 2.13): the name stays after the export returns."""
    before = capture_globals()
    torch.export.export(_Relu(), (torch.randn(2, 4),), strict=True)
    added = _captured(before)
    assert len(added) == 1
    graph = vars(functional_export)[added[0]]
    assert isinstance(graph, torch.nn.Module)  # dynamo's OptimizedModule over the captured GraphModule
    assert forget_captured_graphs(before) == 1 and _captured(before) == []


def test_counting_export_drops_the_captured_graph_and_it_is_freed():
    before = capture_globals()
    with counting_export():
        program = torch.export.export(_Relu(), (torch.randn(2, 4),), strict=True)
        (name,) = _captured(before)
        captured = weakref.ref(vars(functional_export)[name])
    assert _captured(before) == []
    gc.collect()
    assert captured() is None  # nothing else held it
    x = torch.randn(2, 4)
    assert torch.equal(program.module()(x), _relu_of(program, x))  # the program does not need it


def _relu_of(program, x):
    weight, bias = program.state_dict["linear.weight"], program.state_dict["linear.bias"]
    return torch.relu(x @ weight.T + bias)


def test_names_from_before_and_from_exports_still_in_flight_stay():
    existing = f"{CAPTURED_PREFIX}0_from_before"
    vars(functional_export)[existing] = object()
    try:
        with counting_export():
            with counting_export():
                vars(functional_export)[f"{CAPTURED_PREFIX}inner"] = object()
            assert f"{CAPTURED_PREFIX}inner" in vars(functional_export)  # the outer export is still running
            vars(functional_export)["__import_kept"] = object()  # not a captured graph: never removed
        assert f"{CAPTURED_PREFIX}inner" not in vars(functional_export)
        assert existing in vars(functional_export) and "__import_kept" in vars(functional_export)
    finally:
        for name in (existing, "__import_kept", f"{CAPTURED_PREFIX}inner"):
            vars(functional_export).pop(name, None)


def test_a_failed_export_drops_its_name_too():
    before = capture_globals()
    try:
        with counting_export():
            vars(functional_export)[f"{CAPTURED_PREFIX}failed"] = object()
            raise ValueError("trace failed")
    except ValueError as e:
        assert str(e) == "trace failed"
    assert _captured(before) == []


def test_node_caches_are_emptied():
    graph = torch.fx.symbolic_trace(_Relu()).graph
    nodes = list(graph.nodes)
    assert backend_utils.is_same_node(nodes[0], nodes[0]) is True
    assert backend_utils.is_same_node.cache_info().currsize >= 1
    xnnpack_config.why(nodes[1], "a reason")
    assert xnnpack_config.why.node is nodes[1]
    forget_node_caches()
    assert backend_utils.is_same_node.cache_info().currsize == 0
    assert xnnpack_config.why.node is None and xnnpack_config.why.reason == "a reason"
