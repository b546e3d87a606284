"""Checkpoint keys as transformers reads them: its renaming and fusing conversions, planned without a weight read.

transformers 5 converts a checkpoint as ``from_pretrained`` loads it
(``core_model_loading.convert_and_load_state_dict_in_model`` over the model's
``weight_mapping``, from ``conversion_mapping.get_model_conversion_mapping``):
it renames keys (Mixtral's ``block_sparse_moe.gate`` -> ``mlp.gate``, the
legacy ``LayerNorm.gamma`` -> ``LayerNorm.weight``, the base model prefix added
or dropped) and fuses tensors (Mixtral's ``experts.N.w1`` / ``w3``, stacked and
concatenated into ``mlp.experts.gate_up_proj``). :func:`plan_keys` runs that
very function, with transformers' own tables and operations, on stand-ins: a
``Planned`` tensor (:func:`planned_type`) has the checkpoint tensor's shape and dtype and no
storage, and records what each operation makes of the checkpoint's bytes (a
stack, a concatenation, a split or slice, a view, a dtype conversion) as a
list of element ranges of checkpoint keys, in the result's row-major order.
Nothing is read. An operation that reorders elements within a tensor (a
transpose, a permutation) is not planned: transformers records the failure as
it records its own (``log_conversion_errors``), and it is refused by name.

Each model tensor transformers would load becomes a :class:`Recipe`: one whole
checkpoint key (a renamed key) or the byte ranges of several (a fused tensor,
which :meth:`~ptdstream.sources.checkpoint_base.Checkpoint.derive` turns into a
key whose source reads those ranges in order, piece by piece). What
transformers cannot load (a model key no checkpoint key becomes, a shape
that does not fit, a conversion that fails) comes back as transformers reports it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..upstream import adapter
from .convert import convertible
from .errors import BindingError
from .storage_less import is_storage_less, storage_less, storage_less_model

__all__ = ["UNPLANNED", "KeyPlan", "Recipe", "plan_keys", "planned_type", "record_keys"]

#: Begins the message of an operation the stand-ins do not plan (transformers records it as a conversion error).
UNPLANNED = "not read in pieces by the weightless route"


@dataclass(frozen=True)
class Recipe:
    """A model tensor as transformers builds it from the checkpoint: a row-major
    ``dtype`` tensor of ``shape`` whose elements are ``segments`` ((checkpoint
    key, first element, element count), in order) converted from their stored dtype."""

    shape: tuple[int, ...]
    dtype: Any
    segments: tuple[tuple[str, int, int], ...]

    def whole_key(self, entries: Mapping[str, Any]) -> str | None:
        """The checkpoint key this is, whole and in its shape (a renamed key), else None."""
        if len(self.segments) != 1:
            return None
        key, start, count = self.segments[0]
        entry = entries[key]
        numel = 1
        for s in entry.shape:
            numel *= s
        return key if start == 0 and count == numel and tuple(entry.shape) == self.shape else None

    def parts(self, entries: Mapping[str, Any]) -> tuple[tuple[str, int, int], ...]:
        """The segments as byte ranges (checkpoint key, byte offset, byte count).

        Raises:
            ValueError: the segments' keys are of several dtypes, or not row-major.
        """
        dtypes = {entries[key].dtype for key, _, _ in self.segments}
        if len(dtypes) > 1:
            raise ValueError(f"its pieces are of {len(dtypes)} dtypes ({', '.join(sorted(map(str, dtypes)))})")
        for key, _, _ in self.segments:
            if tuple(entries[key].dim_order) != tuple(range(len(entries[key].shape))):
                raise ValueError(f"checkpoint key {key!r} is not row-major")
        size = next(iter(dtypes)).itemsize if dtypes else 1
        return tuple((key, start * size, count * size) for key, start, count in self.segments)


def _elements(segments: tuple[tuple[str, int, int], ...], ends: list[int], start: int,
              count: int) -> list[tuple[str, int, int]]:
    """Elements ``[start, start + count)`` of ``segments`` (``ends``: their running end)."""
    out = []
    i = bisect.bisect_right(ends, start)
    while count > 0:
        key, first, n = segments[i]
        begin = start - (ends[i] - n)
        take = min(n - begin, count)
        out.append((key, first + begin, take))
        start += take
        count -= take
        i += 1
    return out


def _merged(segments: list[tuple[str, int, int]]) -> tuple[tuple[str, int, int], ...]:
    out: list[tuple[str, int, int]] = []
    for key, first, n in segments:
        if n == 0:
            continue
        if out and out[-1][0] == key and out[-1][1] + out[-1][2] == first:
            out[-1] = (key, out[-1][1], out[-1][2] + n)
        else:
            out.append((key, first, n))
    return tuple(out)


def _prod(values: Any) -> int:
    n = 1
    for v in values:
        n *= int(v)
    return n


def _blocks(recipe: Recipe, dim: int, start: int, length: int) -> list[list[tuple[str, int, int]]]:
    """For each index of the dims before ``dim``: the elements of ``[start, start + length)`` along ``dim``."""
    segments = recipe.segments
    ends, total = [], 0
    for _, _, n in segments:
        total += n
        ends.append(total)
    inner = _prod(recipe.shape[dim + 1:])
    full = recipe.shape[dim] * inner
    return [_elements(segments, ends, outer * full + start * inner, length * inner)
            for outer in range(_prod(recipe.shape[:dim]))]


def _narrow(recipe: Recipe, dim: int, start: int, length: int, shape: tuple[int, ...]) -> Recipe:
    return Recipe(shape, recipe.dtype, _merged([s for block in _blocks(recipe, dim, start, length) for s in block]))


def _cat(recipes: list[Recipe], dim: int, shape: tuple[int, ...], dtype: Any) -> Recipe:
    blocks = [_blocks(r, dim, 0, r.shape[dim]) if r.shape else [list(r.segments)] for r in recipes]
    return Recipe(shape, dtype, _merged([s for outer in zip(*blocks, strict=True) for block in outer for s in block]))


def _planned_type() -> type:
    import torch

    def tree_map(fn: Any, value: Any) -> Any:  # an op's arguments: tensors in lists, tuples and dicts
        if isinstance(value, (list, tuple)):
            return type(value)(tree_map(fn, v) for v in value)
        if isinstance(value, dict):
            return {k: tree_map(fn, v) for k, v in value.items()}
        return fn(value)

    class Planned(torch.Tensor):
        """A stand-in for a checkpoint tensor: shape and dtype, no storage, its :class:`Recipe`."""

        recipe: Recipe

        @staticmethod
        def __new__(cls, recipe: Recipe) -> Any:
            return torch.Tensor._make_wrapper_subclass(cls, recipe.shape, dtype=recipe.dtype,
                                                       device=torch.device("cpu"))

        def __init__(self, recipe: Recipe) -> None:
            self.recipe = recipe

        __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's own off switch

        def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]  # no storage to print
            return f"Planned({list(self.recipe.shape)}, {self.recipe.dtype}, {len(self.recipe.segments)} segment(s))"

        @classmethod
        def __torch_dispatch__(  # type: ignore[override]  # torch declares it loosely; a wrapper subclass's form
                cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name == "_to_copy":
                x = args[0]
                return cls(Recipe(x.recipe.shape, kwargs.get("dtype") or x.recipe.dtype, x.recipe.segments))

            def meta(t: Any) -> Any:
                return torch.empty(t.recipe.shape, dtype=t.recipe.dtype, device="meta") if isinstance(t, cls) else t

            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
            x = args[0]
            if name in ("alias", "detach", "clone", "lift_fresh", "view", "_unsafe_view", "reshape", "squeeze",
                        "unsqueeze", "flatten", "contiguous"):
                return cls(Recipe(tuple(out.shape), x.recipe.dtype, x.recipe.segments))
            if name in ("slice", "narrow", "select"):
                dim = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.dim())
                if name == "slice":
                    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
                    if step != 1:
                        raise ValueError(f"{UNPLANNED}: {func} with step {step}")
                    start = args[2] if len(args) > 2 else kwargs.get("start")
                    start = _index(0 if start is None else start, x.shape[dim])
                    return cls(_narrow(x.recipe, dim, start, out.shape[dim], tuple(out.shape)))
                if name == "select":
                    index = _index(args[2], x.shape[dim])
                    return cls(_narrow(x.recipe, dim, index, 1, tuple(out.shape)))
                return cls(_narrow(x.recipe, dim, _index(args[2], x.shape[dim]), args[3], tuple(out.shape)))
            if name in ("split", "split_with_sizes", "unbind", "chunk"):
                dim = _dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), x.dim()) if name != "unbind" else \
                    _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.dim())
                pieces, start = [], 0
                for o in out:
                    length = 1 if name == "unbind" else o.shape[dim]
                    pieces.append(cls(_narrow(x.recipe, dim, start, length, tuple(o.shape))))
                    start += length
                return pieces
            if name in ("cat", "stack"):
                tensors = list(args[0])
                dim = _dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim())
                if not all(isinstance(t, cls) for t in tensors):
                    raise ValueError(f"{UNPLANNED}: {func} of checkpoint tensors with other tensors")
                recipes = [t.recipe for t in tensors]
                if name == "stack":  # each one unsqueezed at dim, then concatenated
                    recipes = [Recipe(r.shape[:dim] + (1,) + r.shape[dim:], r.dtype, r.segments) for r in recipes]
                return cls(_cat(recipes, dim, tuple(out.shape), out.dtype))
            raise ValueError(f"{UNPLANNED}: {func} (it reorders or computes the checkpoint's elements)")

    return Planned


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _index(index: int, size: int) -> int:
    index = index + size if index < 0 else index
    return max(0, min(index, size))


_PLANNED: list[type] = []


def planned_type() -> type:
    """The ``Planned`` tensor class: a stand-in for a checkpoint tensor (shape and
    dtype, no storage) carrying its :class:`Recipe` (made once; torch is imported lazily)."""
    if not _PLANNED:
        _PLANNED.append(_planned_type())
    return _PLANNED[0]


@dataclass
class KeyPlan:
    """What :func:`plan_keys` found: ``loaded`` (each model ``state_dict`` key
    transformers would load -> its :class:`Recipe`), ``missing`` (model keys no
    checkpoint key becomes, as transformers reports them), ``mismatched``
    ((model key, checkpoint shape, model shape)), ``errors`` ({model key:
    transformers' message} of a conversion that failed)."""

    loaded: dict[str, Recipe] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def plan_keys(model: Any, entries: Mapping[str, Any], weight_mapping: Any, dtype: Any = None) -> KeyPlan:
    """Run transformers' ``convert_and_load_state_dict_in_model`` for ``model`` (on
    the meta device, as ``from_pretrained`` gives it to ``_load_pretrained_model``)
    over stand-ins of the checkpoint ``entries`` ({key: entry}) with
    ``weight_mapping`` (``from_pretrained``'s, or
    ``get_model_conversion_mapping(model)``) and ``dtype``, reading nothing.

    Each tensor transformers sets on the model is a ``Planned`` tensor
    afterwards; the caller replaces them (their recipes are in the plan).

    Raises:
        ImportError: transformers is not installed.
    """
    planned: Any = planned_type()
    stand_ins = {key: planned(Recipe(tuple(e.shape), e.dtype, ((key, 0, _prod(e.shape)),)))
                 for key, e in entries.items()}
    missing, _, mismatched, _, errors = adapter.convert_and_load_state_dict(
        model, stand_ins, list(weight_mapping or []), dtype, getattr(model, "dtype_plan", None))
    plan = KeyPlan(missing=set(missing), errors={k: str(v) for k, v in (errors or {}).items()},
                   mismatched=[(k, tuple(a), tuple(b)) for k, a, b in sorted(mismatched)])
    for key, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, planned):
            plan.loaded[key] = tensor.recipe
    return plan


def record_keys(model: Any, weights: Any, weight_mapping: Any, dtype: Any = None) -> set[str]:
    """Make ``model``'s parameters storage-less and record each one on ``weights``
    (a :class:`~ptdstream.weightless.WeightsFrom`) with its checkpoint key as
    transformers reads the checkpoint (:func:`plan_keys`): a renamed key by its
    checkpoint name, a fused tensor by a key derived from its pieces
    (:meth:`~ptdstream.sources.checkpoint_base.Checkpoint.derive`, read in
    order when bound); persistent buffers transformers loads become storage-less
    too. Ties the weights as ``from_pretrained`` does. Returns transformers'
    missing keys.

    Raises:
        BindingError: every weight transformers could not load (a key none
            becomes, a shape that does not fit, a conversion that fails) or
            that the checkpoint holds in a dtype not converted to the model's
            (float32, float16 and bfloat16 are, to one another, when bound or
            quantized, as ``from_pretrained`` converts them), at once, by name.
    """
    checkpoint = weights.checkpoint
    held = checkpoint.entries
    # transformers' own renaming and fusing, planned on stand-ins: each model key it loads gets its recipe
    plan = plan_keys(model, held, weight_mapping, dtype)
    planned = planned_type()
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, value in list(table.items()):
                if isinstance(value, planned):  # its value is the checkpoint's, as when loaded
                    table[attr] = storage_less(value)
    storage_less_model(model)
    for param in model.parameters():
        param._is_hf_initialized = True
    missing = set(plan.missing)
    model.tie_weights(missing_keys=missing, recompute_mapping=False)
    state = model.state_dict(keep_vars=True)
    keys: dict[int, str] = {}  # id(tensor) -> its model key: for a tied group, the one transformers loads
    for key, tensor in state.items():
        if is_storage_less(tensor) and (id(tensor) not in keys or key in plan.loaded
                                        and keys[id(tensor)] not in plan.loaded):
            keys[id(tensor)] = key
    mismatched = {k: (a, b) for k, a, b in plan.mismatched}
    problems = []
    for tensor in {id(t): t for t in state.values() if id(t) in keys}.values():
        key = keys[id(tensor)]
        recipe = plan.loaded.get(key)
        if key in plan.errors and UNPLANNED in plan.errors[key]:
            problems.append(f"converting: the model's {key!r}: transformers builds it from the checkpoint with an "
                            f"operation {' '.join(plan.errors[key].split())}: export it with the weights loaded")
        elif key in plan.errors:
            problems.append(f"converting: the model's {key!r}: transformers could not build it from the "
                            f"checkpoint: {' '.join(plan.errors[key].split())} (from_pretrained refuses it too)")
        elif key in mismatched:
            problems.append(f"shape: the model's {key!r}: the checkpoint holds {list(mismatched[key][0])}, the "
                            f"model needs {list(mismatched[key][1])} (from_pretrained refuses it too, unless "
                            "ignore_mismatched_sizes=True initializes it at random)")
        elif recipe is None:
            problems.append(f"missing: the model's {key!r} ({tensor.dtype} {list(tensor.shape)}) is not in "
                            "the checkpoint, under its name or any name transformers converts to it "
                            "(from_pretrained would initialize it at random)")
        else:
            source = recipe.whole_key(held) or _derived(checkpoint, key, recipe, problems)
            if source is None:
                continue
            weights.record(tensor, source)
            entry = held[source]
            if (entry.dtype != tensor.dtype and not convertible(entry.dtype, tensor.dtype)
                    or tuple(entry.shape) != tuple(tensor.shape)):  # a float dtype converted as from_pretrained does
                problems.append(f"{key!r} ({entry.where}): the checkpoint holds {entry.dtype} "
                                f"{list(entry.shape)}, the model needs {tensor.dtype} {list(tensor.shape)}")
    if problems:
        raise BindingError(checkpoint.path, problems)
    return missing


def _derived(checkpoint: Any, key: str, recipe: Any, problems: list[str]) -> str | None:
    """The checkpoint key of a fused tensor (model key ``key``: ``recipe``'s pieces, read in
    order), added to ``checkpoint`` once; None (a problem added) when it cannot be read in pieces."""
    name = key if key not in checkpoint.entries or key in checkpoint.derived else f"{key} (fused)"
    if name in checkpoint.derived:
        return name
    sources = list(dict.fromkeys(k for k, _, _ in recipe.segments))
    try:
        parts = recipe.parts(checkpoint.entries)
        stored = checkpoint.entries[sources[0]].dtype
        checkpoint.derive(name, parts, stored, recipe.shape,
                          f"fused by transformers from {len(sources)} key(s) ({', '.join(repr(k) for k in sources[:3])}"
                          f"{', ...' if len(sources) > 3 else ''})")
    except ValueError as e:
        problems.append(f"converting: the model's {key!r}: transformers fuses it from {len(sources)} checkpoint "
                        f"key(s), which cannot be read in pieces: {e}")
        return None
    return name
