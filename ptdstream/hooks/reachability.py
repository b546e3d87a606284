"""The partitioners' reachability as bitsets: the same answers in memory linear in the graph.

``torch.fx.passes.infra.partitioner._DependencyViewer`` (which
``CapabilityBasedPartitioner.__init__`` builds) and executorch's
``exir/backend/canonical_partitioners/group_partitioner.py::_DependencyViewer``
(which ``GroupBasedPartitioner``, XNNPACK's partitioner, builds as well) keep,
for every node of the graph, a Python ``set`` of every node downstream of it
(executorch's also of every node upstream): quadratic in the node count. A
Llama decoder lowered to XNNPACK has about 90 nodes per layer, so 18 layers
hold 3.3 million set entries while a program is partitioned, and the memory
stays with the process once freed.

:class:`DependencyViewer` computes the same sets, visiting the nodes in the
same order with the same rule (a node's set is each user, and that user's set
as it stands then; upstream: each input node and its set), as one Python
``int`` per node whose bit ``i`` is node ``i`` of the graph: ``n * n / 8``
bytes. ``downstreams_of(node)`` and ``upstreams_of(node)`` return a read-only
:class:`NodeSet` view (membership, length, iteration in graph order; ``==`` to
upstream's ``set``). What upstream's partitioners compute from these sets does
not depend on their iteration order: whether a merge would make a cycle (a
yes/no over every node of the set) and unions of partition ids. So the
partitions, and every byte after them, are the same.

:func:`compact_dependency_viewers` shadows both modules' ``_DependencyViewer``
while active (through :mod:`ptdstream.upstream.patching`). The names are
registered in :mod:`ptdstream.upstream.names`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed

__all__ = ["DependencyViewer", "NodeSet", "compact_dependency_viewers"]

_BITS = tuple(tuple((byte >> i) & 1 for i in range(8)) for byte in range(256))  # a byte's bits, lowest first


class NodeSet(AbstractSet):
    """A read-only set of graph nodes: bit ``i`` of ``mask`` is ``nodes[i]``."""

    __slots__ = ("_index", "_mask", "_nodes")

    def __init__(self, mask: int, nodes: list[Any], index: dict[Any, int]) -> None:
        self._mask, self._nodes, self._index = mask, nodes, index

    def __contains__(self, node: object) -> bool:
        try:
            i = self._index.get(node)
        except TypeError:  # unhashable: in no set of nodes
            return False
        return i is not None and (self._mask >> i) & 1 == 1

    def __iter__(self) -> Iterator[Any]:
        raw = self._mask.to_bytes((len(self._nodes) + 7) // 8, "little")
        return itertools.compress(self._nodes, itertools.chain.from_iterable(map(_BITS.__getitem__, raw)))

    def __len__(self) -> int:
        return self._mask.bit_count()

    def __repr__(self) -> str:
        return f"NodeSet({{{', '.join(str(n) for n in self)}}})"


class DependencyViewer:
    """Drop-in for upstream's ``_DependencyViewer`` (both): for each node of
    ``graph_module.graph``, the nodes downstream (``downstreams_of``) and upstream
    (``upstreams_of``) of it, taken when built, as upstream's are. A node the graph
    did not have then gets an empty set."""

    def __init__(self, graph_module: Any) -> None:
        self._nodes: list[Any] = []
        self._index: dict[Any, int] = {}
        nodes = list(graph_module.graph.nodes)
        for node in nodes:
            self._bit(node)
        self._down = self._closure(reversed(nodes), lambda node: node.users)
        self._up = self._closure(nodes, lambda node: node.all_input_nodes)

    def _bit(self, node: Any) -> int:
        i = self._index.get(node)
        if i is None:
            i = self._index[node] = len(self._nodes)
            self._nodes.append(node)
        return 1 << i

    def _closure(self, order: Iterable[Any], neighbours) -> dict[Any, int]:
        masks: dict[Any, int] = {}
        for node in order:
            mask = masks.get(node, 0)
            for other in neighbours(node):
                mask |= self._bit(other) | masks.get(other, 0)
            if mask:
                masks[node] = mask
        return masks

    def downstreams_of(self, node: Any) -> NodeSet:
        """Every node reachable from ``node`` through its users."""
        return NodeSet(self._down.get(node, 0), self._nodes, self._index)

    def upstreams_of(self, node: Any) -> NodeSet:
        """Every node ``node`` is reachable from through input nodes."""
        return NodeSet(self._up.get(node, 0), self._nodes, self._index)


@contextlib.contextmanager
def compact_dependency_viewers() -> Iterator[None]:
    """While active, torch's ``CapabilityBasedPartitioner`` and executorch's
    ``GroupBasedPartitioner`` build a :class:`DependencyViewer`. Nests; the patches
    are removed when the last context exits."""
    with contextlib.ExitStack() as patches:
        for module in adapter.partitioner_modules():
            patches.enter_context(shadowed(module, "_DependencyViewer", DependencyViewer))
        yield
