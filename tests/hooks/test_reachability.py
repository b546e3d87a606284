"""hooks.reachability: the partitioners' closure sets as bitsets, the same sets
and the same partitions as upstream's, in memory linear in the graph."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from executorch.exir import to_edge
from executorch.exir.backend.canonical_partitioners import group_partitioner
from torch.fx.passes.infra import partitioner as fx_partitioner

from ptdstream.hooks.reachability import DependencyViewer, NodeSet, compact_dependency_viewers
from ptdstream.hooks.xnnpack import xnnpack_constants_by_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "weightless"))
import _llama  # the tests' tiny decoder, beside the weightless tests

UPSTREAM_FX = fx_partitioner._DependencyViewer
UPSTREAM_GROUP = group_partitioner._DependencyViewer


def _edge_graph_module(layers: int = 2):
    model = _llama.seeded(layers)
    tokens, input_pos = _llama.methods()["prefill"]
    program = torch.export.export(model, (tokens, input_pos), strict=False)
    return to_edge(program).exported_program().graph_module


def _assert_same_sets(graph_module, extra_nodes=()):
    ours = DependencyViewer(graph_module)
    fx_view, group_view = UPSTREAM_FX(graph_module), UPSTREAM_GROUP(graph_module)
    nodes = list(graph_module.graph.nodes) + list(extra_nodes)
    for node in nodes:
        down = ours.downstreams_of(node)
        assert down == fx_view.downstreams[node] == group_view.downstreams_of(node), node.name
        assert ours.upstreams_of(node) == group_view.upstreams_of(node), node.name
        assert len(down) == len(group_view.downstreams_of(node))
    return ours, nodes


def test_an_edge_programs_closures_equal_upstreams_for_every_node():
    gm = _edge_graph_module()
    ours, nodes = _assert_same_sets(gm)
    assert len(nodes) > 150
    # iteration is in graph order, each node once
    order = {node: i for i, node in enumerate(nodes)}
    first = nodes[0]
    listed = list(ours.downstreams_of(first))
    assert listed == sorted(listed, key=order.__getitem__) and len(set(listed)) == len(listed)
    assert len(listed) > 100


def test_a_graph_out_of_topological_order_gets_upstreams_partial_sets():
    # upstream builds the sets in one pass (reversed for downstreams): a user placed
    # before its input has, at that time, no set yet; the bitsets follow the same rule
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(torch.neg, (a,))
    c = graph.call_function(torch.sin, (b,))
    d = graph.call_function(torch.add, (c, a))
    graph.output(d)
    x.prepend(c)  # order: c, x, a, b, d, output; c uses b, which now comes after it
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    ours, _ = _assert_same_sets(gm)
    out = gm.graph.output_node()
    assert set(ours.downstreams_of(b)) == {c}  # c not visited yet (reversed order: output, d, b, a, x, c)
    assert set(ours.downstreams_of(a)) == {b, c, d, out}
    assert set(ours.upstreams_of(c)) == {b}  # b not visited yet (graph order: c first)
    assert set(ours.upstreams_of(d)) == {a, b, c, x}


def test_a_node_the_graph_did_not_have_and_non_nodes_are_in_no_set():
    gm = _edge_graph_module(layers=1)
    outside = _edge_graph_module(layers=1)
    stranger = next(iter(outside.graph.nodes))
    ours, _ = _assert_same_sets(gm, extra_nodes=[stranger])
    assert ours.downstreams_of(stranger) == set() and ours.upstreams_of(stranger) == set()
    first = next(iter(gm.graph.nodes))
    down = ours.downstreams_of(first)
    assert stranger not in down and "x" not in down and None not in down
    with pytest.raises(TypeError):
        [] in down  # noqa: B015 - unhashable, as for upstream's set
    assert isinstance(down, NodeSet)
    listed = set(down)
    assert down | {stranger} == listed | {stranger} and isinstance(down | {stranger}, set)
    assert down - {first} == listed - {first} and down & listed == listed and down.copy() == listed
    assert down.union([stranger]) == listed | {stranger}
    with pytest.raises(AttributeError):
        down.add(stranger)  # read-only


def test_partitions_and_files_equal_upstreams_under_the_patch(tmp_path):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model = _llama.seeded(2).requires_grad_(False)
    example = _llama.methods()["prefill"]

    def lowered():
        program = torch.export.export(model, example, strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        return edge, edge.to_executorch().buffer

    plain_edge, plain = lowered()
    with compact_dependency_viewers():
        assert fx_partitioner._DependencyViewer is DependencyViewer
        assert group_partitioner._DependencyViewer is DependencyViewer
        patched_edge, patched = lowered()
    assert fx_partitioner._DependencyViewer is UPSTREAM_FX
    assert group_partitioner._DependencyViewer is UPSTREAM_GROUP

    def delegates(edge):
        gm = edge.exported_program().graph_module
        return [(name, sorted(n.name for n in mod.original_module.graph.nodes))
                for name, mod in gm.named_children()]

    assert len(delegates(plain_edge)) > 1
    assert delegates(patched_edge) == delegates(plain_edge)
    assert patched == plain


def test_xnnpack_constants_by_reference_enters_it_and_restores_upstreams():
    with xnnpack_constants_by_reference():
        assert group_partitioner._DependencyViewer is DependencyViewer
        with xnnpack_constants_by_reference():
            assert fx_partitioner._DependencyViewer is DependencyViewer
        assert group_partitioner._DependencyViewer is DependencyViewer
    assert group_partitioner._DependencyViewer is UPSTREAM_GROUP
    assert fx_partitioner._DependencyViewer is UPSTREAM_FX


def test_memory_is_a_bit_per_node_pair_not_a_set_entry():
    gm = _edge_graph_module(layers=4)
    n = len(gm.graph.nodes)
    ours = DependencyViewer(gm)
    entries = sum(len(ours.downstreams_of(node)) + len(ours.upstreams_of(node)) for node in gm.graph.nodes)
    assert entries > n * n // 4  # the closures are large (a chain of layers)...
    bits = sum(sys.getsizeof(m) for m in (*ours._down.values(), *ours._up.values()))
    upstream = UPSTREAM_GROUP(gm)
    sets = sum(sys.getsizeof(s) for s in (*upstream.downstreams.values(), *upstream.upstreams.values()))
    assert bits * 10 < sets  # ...and held as bits: over 10x less than upstream's sets


def test_decoded_sets_kept_stay_within_their_budget_and_answer_the_same(monkeypatch):
    import ptdstream.hooks.reachability as reachability

    gm = _edge_graph_module(layers=2)
    upstream = UPSTREAM_GROUP(gm)
    monkeypatch.setattr(reachability, "LISTED_NODES", 500)
    ours = DependencyViewer(gm)
    nodes = list(gm.graph.nodes)
    for _ in range(2):  # the second round reads sets evicted in the first
        for node in nodes:
            assert set(ours.downstreams_of(node)) == upstream.downstreams_of(node), node.name
            assert ours._listed_nodes <= 500 or len(ours._listed) == 1
    assert 1 < len(ours._listed) < len(nodes)
    assert ours._listed_nodes == sum(len(members) for _, members in ours._listed.values())


def test_a_nodeset_over_a_freed_mask_never_reads_another_masks_cached_nodes():
    gm = _edge_graph_module(layers=1)
    ours = DependencyViewer(gm)
    nodes = list(gm.graph.nodes)
    for i in range(200):  # ints made and freed: their ids are reused by the next ones
        mask = int("1" * (i % 7 + 1), 2) << (i % 11)
        want = {nodes[j] for j in range(len(nodes)) if mask >> j & 1}
        got = NodeSet(mask, ours)
        assert set(got) == want and len(list(got)) == len(got) == len(want), i
        del mask, got
