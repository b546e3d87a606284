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
checkpoint key no group uses, a dtype, shape or dim order that differs. The
dtype must be equal: a checkpoint stored in another dtype than the export's is
refused, not converted. A constant that ``constant_prop_pass`` folded from
storage-less weights has no checkpoint key and is named as such: its values
need the weights' (a pass run after binding computes them from the mapped
checkpoint and holds the folded constants in memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointMismatchError, PtdstreamError
from .quantization import ADVICE, derived_from_storage_less
from .storage_less import is_storage_less

#: The name prefix of constants ``constant_prop_pass`` folds (``exir/passes/constant_prop_pass.py``).
FOLDED_PREFIX = "_prop_tensor_constant"

__all__ = ["FOLDED_PREFIX", "BindingError", "BindingPlan", "UnboundConstantError", "bind_programs", "plan_binding",
           "unbound_constants"]


class BindingError(CheckpointMismatchError):
    """The checkpoint does not fit the exported programs' storage-less constants.

    ``problems`` lists every one, each naming the FQN, the checkpoint key and
    file, and both dtypes or shapes. Nothing was bound.
    """

    def __init__(self, checkpoint: str, problems: list[str]) -> None:
        super().__init__("the exported program's storage-less constants (nothing bound)", checkpoint, problems)
        self.args = (self.args[0] + "\nfix the checkpoint, or map names with key_map={fqn: checkpoint key}",)


class UnboundConstantError(PtdstreamError, ValueError):
    """A constant that holds no bytes reached emission or a save: bind the exported
    program first (``weights.bind(exported_program)``). ``names`` lists them."""

    def __init__(self, names: list[str], where: str) -> None:
        self.names = list(names)
        super().__init__(
            f"{where}: {len(names)} constant(s) hold no bytes (storage-less, never bound to a checkpoint "
            f"tensor): {', '.join(names)}; call weights.bind(exported_program) after torch.export, "
            "before to_edge")


@dataclass(frozen=True)
class BindingPlan:
    """What :func:`bind_programs` will do: ``groups`` maps each checkpoint key to
    the ``(method, table, fqn)`` places its tensor fills (``table`` is
    ``"state_dict"`` or ``"constants"``)."""

    groups: Mapping[str, tuple[tuple[str, str, str], ...]]


def _places(programs: Mapping[str, Any]) -> dict[int, list[tuple[str, str, str, Any]]]:
    """id(storage-less tensor) -> its places, in program order."""
    found: dict[int, list[tuple[str, str, str, Any]]] = {}
    for method, ep in programs.items():
        for table in ("state_dict", "constants"):
            for fqn, tensor in getattr(ep, table).items():
                if is_storage_less(tensor):
                    found.setdefault(id(tensor), []).append((method, table, fqn, tensor))
    return found


def _describe(entry: Any) -> str:
    return f"{entry.dtype} {list(entry.shape)}"


def plan_binding(programs: Mapping[str, Any], checkpoint: Any, key_map: Mapping[str, str] | None = None,
                 allow_extra: bool = False) -> BindingPlan:
    """Match every storage-less constant of ``programs`` ({method: ExportedProgram})
    to a key of ``checkpoint`` (a :class:`~ptdstream.sources.checkpoint.Checkpoint`).

    A group of tied names takes the first of its names (in program order, after
    ``key_map``) that the checkpoint holds; each of its names the checkpoint
    also holds must agree with it.

    Raises:
        BindingError: every missing key, extra key (unless ``allow_extra``),
            dtype, shape or dim-order mismatch, and every quantized constant
            made from storage-less weights, all at once.
    """
    key_map = dict(key_map or {})
    entries = checkpoint.entries
    problems: list[str] = []
    groups: dict[str, tuple[tuple[str, str, str], ...]] = {}
    used: set[str] = set()
    for places in _places(programs).values():
        keys = [key_map.get(fqn, fqn) for _, _, fqn, _ in places]
        held = [k for k in dict.fromkeys(keys) if k in entries]
        names = ", ".join(f"{fqn!r}" + (f" (method {m!r})" if len(programs) > 1 else "") for m, _, fqn, _ in places)
        if not held:
            wanted = ", ".join(repr(k) for k in dict.fromkeys(keys))
            folded = any(fqn.startswith(FOLDED_PREFIX) for _, _, fqn, _ in places)
            problems.append(f"missing: {names} needs checkpoint key {wanted}, which the checkpoint does not hold"
                            + (" (a constant that constant_prop_pass folded from storage-less weights: it "
                               "needs their values, so bind before constant_prop_pass)" if folded else ""))
            continue
        used.update(held)
        tensor = places[0][3]
        for key in held:
            entry = entries[key]
            where = f"{names} <- key {key!r} ({entry.where})"
            if entry.dtype != tensor.dtype:
                problems.append(f"dtype: {where}: the checkpoint holds {entry.dtype}, the export needs "
                                f"{tensor.dtype}")
            if tuple(entry.shape) != tuple(tensor.shape):
                problems.append(f"shape: {where}: the checkpoint holds {list(entry.shape)}, the export needs "
                                f"{list(tensor.shape)}")
            elif tensor.dim() and tuple(entry.dim_order) != _dim_order(tensor):
                problems.append(f"dim order: {where}: the checkpoint holds {list(entry.dim_order)}, the export "
                                f"needs {list(_dim_order(tensor))}")
        groups[held[0]] = tuple((m, t, fqn) for m, t, fqn, _ in places)
    for method, ep in programs.items():
        for table in ("state_dict", "constants"):
            for fqn, tensor in getattr(ep, table).items():
                if derived_from_storage_less(tensor):
                    used.add(key_map.get(fqn, fqn))  # its checkpoint key is not extra: it is this one's
                    where = f"{fqn!r}" + (f" (method {method!r})" if len(programs) > 1 else "")
                    problems.append(f"quantized: {where} is a {type(tensor).__name__} made from a storage-less "
                                    f"weight (its inner tensors hold no bytes); {ADVICE}")
    if not allow_extra:
        for key, entry in entries.items():
            if key not in used and checkpoint.aliases.get(key, key) not in used:
                problems.append(f"extra: checkpoint key {key!r} ({_describe(entry)}, {entry.where}) is no "
                                "storage-less constant of the export (pass allow_extra=True to ignore it)")
    if problems:
        raise BindingError(checkpoint.path, problems)
    return BindingPlan(groups)


def _dim_order(tensor: Any) -> tuple[int, ...]:
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda d: (-strides[d], d)))


def bind_programs(programs: Mapping[str, Any], checkpoint: Any, plan: BindingPlan,
                  tensor_of: Any) -> list[Any]:
    """Replace each planned place by the checkpoint's tensor (``tensor_of(key)``:
    memory-mapped, nothing read), one tensor object per group; parameters stay
    ``torch.nn.Parameter`` with their ``requires_grad``. Returns the tensors placed."""
    import torch

    placed: dict[int, Any] = {}
    for key, places in plan.groups.items():
        mapped = tensor_of(key)
        made: dict[bool, Any] = {}
        for method, table, fqn in places:
            old = getattr(programs[method], table)[fqn]
            if isinstance(old, torch.nn.Parameter):
                if old.requires_grad not in made:
                    made[old.requires_grad] = torch.nn.Parameter(mapped, requires_grad=old.requires_grad)
                new = made[old.requires_grad]
            else:
                new = mapped
            getattr(programs[method], table)[fqn] = new
            placed[id(new)] = new
    return list(placed.values())


def unbound_constants(programs: Mapping[str, Any]) -> list[str]:
    """``"method: fqn"`` of every storage-less constant left in ``programs``, sorted."""
    return sorted(f"{m}: {fqn!r}" for places in _places(programs).values() for m, _, fqn, _ in places)
