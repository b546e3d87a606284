"""Binding the storage-less constants of exported programs to a checkpoint's tensors.

Every storage-less tensor (see :mod:`ptdstream.weightless.storage_less`) among
an ``ExportedProgram``'s ``state_dict`` (parameters, persistent buffers) and
``constants`` (lifted constants, non-persistent buffers) is looked up by its
fully qualified name (FQN), through ``key_map`` (FQN -> checkpoint key) where
the names differ, and replaced by the checkpoint's memory-mapped tensor:
nothing is read then. Names that share one tensor object (tied weights, in one
program or across the methods of a multi-method export) form one group, bound
once to one checkpoint tensor.

All checks are made before any program is changed, and every problem is
reported at once (:class:`BindingError`): a group with no checkpoint key, a
checkpoint key no group uses, a dtype, shape or dim order that differs. A
dtype that differs is converted when both are float32, float16 or bfloat16
(:func:`~ptdstream.weightless.convert.convertible`; the plan's ``converted``
names those keys and their export dtype), and refused otherwise. A constant
that ``constant_prop_pass`` folded from storage-less weights has no checkpoint
key and is named as such: its values
need the weights' (a pass run after binding computes them from the mapped
checkpoint: :mod:`ptdstream.weightless.folding`). A storage-less buffer the
program mutates and does not initialize (a KV cache: upstream serializes only
its shape) needs no checkpoint key: it stays storage-less unless the checkpoint
holds it.

Binding is idempotent: a constant that is no longer storage-less but is the
tensor a context bound to a key (``origins``: tensor id -> key, see
:class:`~ptdstream.weightless.WeightsFrom`) counts as bound to that key, so a
bound program's unlifted module exported again (XNNPACK's tagging route) binds
with nothing left to do, and no checkpoint key it holds reads as extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .convert import CONVERTIBLE, convertible
from .errors import QUANTIZATION_ADVICE, BindingError
from .storage_less import derived_from_storage_less, is_storage_less

#: The name prefix of constants ``constant_prop_pass`` folds (``exir/passes/constant_prop_pass.py``).
FOLDED_PREFIX = "_prop_tensor_constant"
#: What a storage-less buffer marked for initialization is told (``exir/passes/init_mutable_pass.py``).
INITIALIZED_NOTE = ("(a mutable buffer marked et_init_buffer, by InitializedMutableBufferPass: its initial values are "
                    "serialized; give it real values in the model, or a checkpoint key)")

__all__ = ["FOLDED_PREFIX", "INITIALIZED_NOTE", "BindingPlan", "bind_programs", "needing_values", "plan_binding",
           "unbound_constants", "values_never_serialized"]


@dataclass(frozen=True)
class BindingPlan:
    """What :func:`bind_programs` will do: ``groups`` maps each checkpoint key to
    the ``(method, table, fqn)`` places its tensor fills (``table`` is
    ``"state_dict"`` or ``"constants"``)."""

    groups: Mapping[str, tuple[tuple[str, str, str], ...]]
    #: checkpoint key -> the export's dtype, for each key stored in another float dtype
    converted: Mapping[str, Any] = field(default_factory=dict)


def _places(programs: Mapping[str, Any]) -> dict[int, list[tuple[str, str, str, Any]]]:
    """id(storage-less tensor) -> its places, in program order."""
    found: dict[int, list[tuple[str, str, str, Any]]] = {}
    for method, ep in programs.items():
        for table in ("state_dict", "constants"):
            for fqn, tensor in getattr(ep, table).items():
                if is_storage_less(tensor):
                    found.setdefault(id(tensor), []).append((method, table, fqn, tensor))
    return found


def _buffer_roles(ep: Any) -> tuple[set[str], set[str]]:
    """FQNs of the buffers ``ep`` mutates, and of those marked for initialization.

    Mutated: its signature's ``buffers_to_mutate`` (after functionalization, as
    in ``to_edge``) and the buffers a node writes in place (``torch.export``'s
    non-functional IR: an op whose schema marks the argument written, such as
    ``index_copy_``). Initialized: a placeholder with ``meta["et_init_buffer"]``
    (set by ``exir/passes/init_mutable_pass.py``).
    """
    import torch

    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    initialized = set()
    to_buffers = ep.graph_signature.inputs_to_buffers
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in to_buffers and node.meta.get("et_init_buffer"):
            initialized.add(to_buffers[node.name])
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, torch.fx.Node) and value.op == "placeholder" and value.name in to_buffers:
                    mutated.add(to_buffers[value.name])
    return mutated, initialized


class _Roles:
    """:func:`_buffer_roles` of each program, computed once."""

    def __init__(self, programs: Mapping[str, Any]) -> None:
        self._programs = programs
        self._roles: dict[str, tuple[set[str], set[str]]] = {}

    def of(self, method: str) -> tuple[set[str], set[str]]:
        if method not in self._roles:
            self._roles[method] = _buffer_roles(self._programs[method])
        return self._roles[method]

    def never_serialized(self, method: str, table: str, fqn: str) -> bool:
        """Whether the program serializes only the shape of constant ``fqn``: a
        buffer it mutates and does not initialize (``exir/emit/_emitter.py::placeholder``:
        a mutable buffer's values are written only with ``et_init_buffer``). Such
        a buffer (a KV cache) may stay storage-less."""
        mutated, initialized = self.of(method)
        return table == "state_dict" and fqn in mutated and fqn not in initialized

    def initialized(self, method: str, table: str, fqn: str) -> bool:
        return table == "state_dict" and fqn in self.of(method)[1]


def values_never_serialized(ep: Any, table: str, fqn: str) -> bool:
    """Whether ``ep`` serializes only the shape of its constant ``fqn`` of
    ``table`` (``"state_dict"`` or ``"constants"``): a buffer it mutates and does
    not initialize (a KV cache), which may stay storage-less."""
    return _Roles({"": ep}).never_serialized("", table, fqn)


def _describe(entry: Any) -> str:
    return f"{entry.dtype} {list(entry.shape)}"


def plan_binding(programs: Mapping[str, Any], checkpoint: Any, key_map: Mapping[str, str] | None = None,
                 allow_extra: bool = False, origins: Mapping[int, str] | None = None) -> BindingPlan:
    """Match every storage-less constant of ``programs`` ({method: ExportedProgram})
    to a key of ``checkpoint`` (a :class:`~ptdstream.sources.checkpoint_base.Checkpoint`).

    A constant's key: ``key_map[fqn]`` where ``key_map`` names its FQN, else
    ``origins[id(tensor)]`` (a key recorded for that very tensor: the model's
    own name of it, whatever module wraps the model), else its FQN. A constant
    that is not storage-less and whose tensor ``origins`` records (bound
    already) counts as bound to its recorded key: that key is used, not extra;
    a ``key_map`` that sends it to another key is a problem.

    A group of tied names takes the first of its names (in program order, after
    ``key_map``) that the checkpoint holds; each of its names the checkpoint
    also holds must agree with it. Groups that ``key_map`` sends to one key all
    take its tensor (the export of the model holding those values in each saves
    the same bytes: upstream stores equal data once); they must agree in dtype.

    Raises:
        BindingError: every missing key, extra key (unless ``allow_extra``),
            dtype that is not converted, shape or dim-order mismatch, and every
            quantized constant made from storage-less weights, all at once.
    """
    key_map = dict(key_map or {})
    origins = origins or {}
    entries = checkpoint.entries
    problems: list[str] = []
    groups: dict[str, tuple[tuple[str, str, str], ...]] = {}
    used: set[str] = set()
    converted: dict[str, Any] = {}
    dtypes: dict[str, Any] = {}  # checkpoint key -> the export's dtype of the names bound to it
    roles = _Roles(programs)
    for places in _places(programs).values():
        keys = [key_map.get(fqn, origins.get(id(t), fqn)) for _, _, fqn, t in places]
        held = [k for k in dict.fromkeys(keys) if k in entries]
        names = ", ".join(f"{fqn!r}" + (f" (method {m!r})" if len(programs) > 1 else "") for m, _, fqn, _ in places)
        if not held and all(roles.never_serialized(m, t, fqn) for m, t, fqn, _ in places):
            continue  # a mutable buffer (KV cache) left storage-less: only its shape is serialized
        if not held:
            wanted = ", ".join(repr(k) for k in dict.fromkeys(keys))
            folded = any(fqn.startswith(FOLDED_PREFIX) for _, _, fqn, _ in places)
            initialized = any(roles.initialized(m, t, fqn) for m, t, fqn, _ in places)
            problems.append(f"missing: {names} needs checkpoint key {wanted}, which the checkpoint does not hold"
                            + (" (a constant that constant_prop_pass folded from storage-less weights: it "
                               "needs their values, so bind before constant_prop_pass)" if folded else "")
                            + (f" {INITIALIZED_NOTE}" if initialized else ""))
            continue
        used.update(held)
        tensor = places[0][3]
        for key in held:
            entry = entries[key]
            where = f"{names} <- key {key!r} ({entry.where})"
            if entry.dtype != tensor.dtype and not convertible(entry.dtype, tensor.dtype):
                problems.append(f"dtype: {where}: the checkpoint holds {entry.dtype}, the export needs "
                                f"{tensor.dtype} (only {', '.join(CONVERTIBLE)} are converted, to one another)")
            if tuple(entry.shape) != tuple(tensor.shape):
                problems.append(f"shape: {where}: the checkpoint holds {list(entry.shape)}, the export needs "
                                f"{list(tensor.shape)}")
            elif tensor.dim() and tuple(entry.dim_order) != _dim_order(tensor):
                problems.append(f"dim order: {where}: the checkpoint holds {list(entry.dim_order)}, the export "
                                f"needs {list(_dim_order(tensor))}")
        key = held[0]
        if key in groups and dtypes[key] != tensor.dtype:
            problems.append(f"dtype: {names} and {groups[key][0][2]!r} both map to key {key!r} "
                            f"({entries[key].where}), but the export holds them as {tensor.dtype} and "
                            f"{dtypes[key]}: map them to keys of their own with key_map")
            continue
        # untied names mapped to one key share its tensor: the real export of equal values saves the same bytes
        groups[key] = groups.get(key, ()) + tuple((m, t, fqn) for m, t, fqn, _ in places)
        dtypes[key] = tensor.dtype
        if entries[key].dtype != tensor.dtype:
            converted[key] = tensor.dtype
    for method, ep in programs.items():
        for table in ("state_dict", "constants"):
            for fqn, tensor in getattr(ep, table).items():
                bound_to = origins.get(id(tensor)) if not is_storage_less(tensor) else None
                if bound_to is not None:  # bound already (an export of a bound program's module): counts as bound
                    used.add(bound_to)
                    if key_map.get(fqn, bound_to) != bound_to:
                        problems.append(f"bound: {fqn!r} is bound to checkpoint key {bound_to!r} already, key_map "
                                        f"sends it to {key_map[fqn]!r}: drop it from key_map, or export the "
                                        "model again")
                if derived_from_storage_less(tensor):
                    used.add(key_map.get(fqn, fqn))  # its checkpoint key is not extra: it is this one's
                    where = f"{fqn!r}" + (f" (method {method!r})" if len(programs) > 1 else "")
                    problems.append(f"quantized: {where} is a {type(tensor).__name__} made from a storage-less "
                                    f"weight (its inner tensors hold no bytes); {QUANTIZATION_ADVICE}")
    derived = getattr(checkpoint, "derived", {})
    used.update(part for key in used & derived.keys() for part, _, _ in derived[key])  # a fused key's pieces
    if not allow_extra:
        for key, entry in entries.items():
            if key not in used and key not in derived and checkpoint.aliases.get(key, key) not in used:
                problems.append(f"extra: checkpoint key {key!r} ({_describe(entry)}, {entry.where}) is no "
                                "storage-less constant of the export (pass allow_extra=True to ignore it)")
    if problems:
        raise BindingError(checkpoint.path, problems)
    return BindingPlan(groups, converted)


def _dim_order(tensor: Any) -> tuple[int, ...]:
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda d: (-strides[d], d)))


def bind_programs(programs: Mapping[str, Any], checkpoint: Any, plan: BindingPlan,
                  tensor_of: Any, made_before: dict[tuple[str, bool], Any] | None = None) -> dict[str, list[Any]]:
    """Replace each planned place by the checkpoint's tensor (``tensor_of(key)``:
    memory-mapped, or a converted copy mapped from a file), one tensor object per group; parameters stay
    ``torch.nn.Parameter`` with their ``requires_grad``. ``made_before``: ``{(key, requires_grad): Parameter}``
    of earlier calls, reused and filled (programs bound one at a time get the same objects as bound together).
    Returns the tensors placed, by key."""
    import torch

    placed: dict[str, dict[int, Any]] = {}
    made_before = {} if made_before is None else made_before
    for key, places in plan.groups.items():
        mapped = tensor_of(key)
        made: dict[bool, Any] = {flag: p for (k, flag), p in made_before.items() if k == key}
        for method, table, fqn in places:
            old = getattr(programs[method], table)[fqn]
            if isinstance(old, torch.nn.Parameter):
                if old.requires_grad not in made:
                    made[old.requires_grad] = made_before[key, old.requires_grad] = torch.nn.Parameter(
                        mapped, requires_grad=old.requires_grad)
                new = made[old.requires_grad]
            else:
                new = mapped
            getattr(programs[method], table)[fqn] = new
            placed.setdefault(key, {})[id(new)] = new
    return {key: list(tensors.values()) for key, tensors in placed.items()}


def needing_values(programs: Mapping[str, Any]) -> list[Any]:
    """The storage-less constants of ``programs`` whose values would be serialized
    (all but :func:`values_never_serialized`), each tensor once, in program order."""
    roles = _Roles(programs)
    return [places[0][3] for places in _places(programs).values()
            if not all(roles.never_serialized(m, t, fqn) for m, t, fqn, _ in places)]


def unbound_constants(programs: Mapping[str, Any]) -> list[str]:
    """``"method: fqn"`` of every storage-less constant left in ``programs`` whose
    values would be serialized (all but :func:`values_never_serialized`), sorted;
    a mutable buffer marked for initialization says so."""
    left = []
    roles = _Roles(programs)
    for places in _places(programs).values():
        for m, t, fqn, _ in places:
            if roles.never_serialized(m, t, fqn):
                continue
            left.append(f"{m}: {fqn!r}" + (f" {INITIALIZED_NOTE}" if roles.initialized(m, t, fqn) else ""))
    return sorted(left)
