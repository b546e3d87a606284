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

:class:`DependencyViewer` computes the same sets, visiting the nodes in the same
order with the same rule (a node's set is each user, and that user's set as it
stands then; upstream: each input node and its set), as one Python ``int`` per
node whose bit ``i`` is node ``i`` of the graph: ``n * n / 8`` bytes.
``downstreams_of(node)`` and ``upstreams_of(node)`` return a read-only
:class:`NodeSet` view (membership, length, iteration in graph order, ``copy``,
``union`` and the set operators giving a plain ``set``; ``==`` to upstream's
``set``, though not a ``set`` instance, and the viewer has no ``downstreams``).
What upstream's partitioners compute from these sets does not depend on their
iteration order: whether a merge would make a cycle (a yes/no over every node of
the set) and unions of partition ids. So the partitions, and every byte after
them, are the same.

:func:`compact_dependency_viewers` shadows both modules' ``_DependencyViewer``
while active (through :mod:`ptdstream.upstream.patching`). The names are
registered in :mod:`ptdstream.upstream.names`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed

__all__ = ["DependencyViewer", "NodeSet", "compact_dependency_viewers"]

_BITS = tuple(tuple((byte >> i) & 1 for i in range(8)) for byte in range(256))  # a byte's bits, lowest first
#: node references the decoded sets a viewer keeps (most recently used first) may hold: 16 MiB
LISTED_NODES = 1 << 21


class NodeSet(AbstractSet):
    """A read-only set of the nodes of a :class:`DependencyViewer`'s graph: bit
    ``i`` of ``mask`` is its node ``i``; iterated in graph order."""

    __slots__ = ("_mask", "_viewer")

    def __init__(self, mask: int, viewer: DependencyViewer) -> None:
        self._mask, self._viewer = mask, viewer

    def __contains__(self, node: object) -> bool:
        i = self._viewer._index.get(node)  # an unhashable object raises TypeError, as for a set
        return i is not None and (self._mask >> i) & 1 == 1

    @classmethod
    def _from_iterable(cls, iterable) -> set[Any]:
        return set(iterable)  # ``|``, ``&``, ``-``, ``^`` give a plain set, as upstream's sets do

    def copy(self) -> set[Any]:
        """A plain ``set`` of the nodes."""
        return set(self)

    def union(self, *others: Iterable[Any]) -> set[Any]:
        """A plain ``set`` of the nodes and those of ``others``."""
        return set(self).union(*others)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._viewer._members(self._mask))

    def __len__(self) -> int:
        return self._mask.bit_count()

    def __repr__(self) -> str:
        return f"NodeSet({{{', '.join(str(n) for n in self)}}})"


class DependencyViewer:
    """Answers the queries of upstream's ``_DependencyViewer`` (both): for each node of
    ``graph_module.graph``, the nodes downstream (``downstreams_of``) and upstream
    (``upstreams_of``) of it, taken when built, as upstream's are. A node the graph
    did not have then gets an empty set."""

    def __init__(self, graph_module: Any) -> None:
        self._nodes: list[Any] = []
        self._index: dict[Any, int] = {}
        self._order = list(graph_module.graph.nodes)
        for node in self._order:
            self._bit(node)
        # each direction's sets from the nodes' edges as they are now, made on first use
        self._users = {node: list(node.users) for node in self._order}
        self._inputs = {node: list(node.all_input_nodes) for node in self._order}
        self._down_masks: dict[Any, int] | None = None
        self._up_masks: dict[Any, int] | None = None
        self._listed: collections.OrderedDict[int, tuple[int, tuple[Any, ...]]] = collections.OrderedDict()
        self._listed_nodes = 0

    @property
    def _down(self) -> dict[Any, int]:
        if self._down_masks is None:
            self._down_masks = self._closure(reversed(self._order), self._users)
        return self._down_masks

    @property
    def _up(self) -> dict[Any, int]:
        if self._up_masks is None:
            self._up_masks = self._closure(self._order, self._inputs)
        return self._up_masks

    def _bit(self, node: Any) -> int:
        i = self._index.get(node)
        if i is None:
            i = self._index[node] = len(self._nodes)
            self._nodes.append(node)
        return 1 << i

    def _closure(self, order: Iterable[Any], neighbours: dict[Any, list[Any]]) -> dict[Any, int]:
        masks: dict[Any, int] = {}
        for node in order:
            mask = masks.get(node, 0)
            for other in neighbours[node]:
                mask |= self._bit(other) | masks.get(other, 0)
            if mask:
                masks[node] = mask
        return masks

    def _members(self, mask: int) -> tuple[Any, ...]:
        """The nodes of ``mask`` in graph order; the most recently used kept,
        :data:`LISTED_NODES` references in all (partitioners ask for the same sets
        again and again)."""
        key = id(mask)
        entry = self._listed.get(key)
        if entry is not None and entry[0] is mask:  # the entry holds its mask: its id is not reused meanwhile
            self._listed.move_to_end(key)
            return entry[1]
        raw = mask.to_bytes((len(self._nodes) + 7) // 8, "little")
        members = tuple(itertools.compress(self._nodes, itertools.chain.from_iterable(map(_BITS.__getitem__, raw))))
        if entry is not None:
            self._listed_nodes -= len(self._listed.pop(key)[1])
        self._listed[key] = (mask, members)
        self._listed_nodes += len(members)
        while self._listed_nodes > LISTED_NODES and len(self._listed) > 1:
            self._listed_nodes -= len(self._listed.popitem(last=False)[1][1])
        return members

    def downstreams_of(self, node: Any) -> NodeSet:
        """Every node reachable from ``node`` through its users."""
        return NodeSet(self._down.get(node, 0), self)

    def upstreams_of(self, node: Any) -> NodeSet:
        """Every node ``node`` is reachable from through input nodes."""
        return NodeSet(self._up.get(node, 0), self)


@contextlib.contextmanager
def compact_dependency_viewers() -> Iterator[None]:
    """While active, torch's ``CapabilityBasedPartitioner`` and executorch's
    ``GroupBasedPartitioner`` build a :class:`DependencyViewer`. Nests; the patches
    are removed when the last context exits."""
    with contextlib.ExitStack() as patches:
        for module in adapter.partitioner_modules():
            patches.enter_context(shadowed(module, "_DependencyViewer", DependencyViewer))
        yield
