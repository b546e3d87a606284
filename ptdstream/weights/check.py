"""Checking a checkpoint against a program's external weights, for :func:`ptdstream.write_ptd`.

Each problem is one line naming the key and the option that resolves it:
``key_map`` (``--map``) for a weight under another name (a tied weight saved
under its twin's name: the checkpoint key with the missing weight's dtype and
shape is named), ``keep`` (``--keep``) for a key the old ``.ptd`` files hold that
no checkpoint saves (a non-persistent buffer such as a causal mask: its
exported bytes are copied unchanged), ``allow_extra`` (``--allow-extra``) for
checkpoint keys the program does not use.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..sources.checkpoint_base import Checkpoint

__all__ = ["Located", "check_keys", "describe_layout", "like_tag", "mapper", "tags_and_order"]

KeyMap = Mapping[str, str] | Callable[[str], str | None] | None
#: Where a like= file holds a key: ``(path, file offset, bytes)``.
Located = tuple[str, int, int]


def mapper(key_map: KeyMap) -> Callable[[str], str | None]:
    """``fqn -> checkpoint key`` of ``key_map``: identity, a callable, or
    ``{program_prefix: checkpoint_prefix}`` (the first prefix that matches)."""
    if key_map is None:
        return lambda k: k
    if callable(key_map):
        return key_map
    pairs = list(key_map.items())

    def rename(key: str) -> str | None:
        for old, new in pairs:
            if key.startswith(old):
                return new + key[len(old):]
        return key

    return rename


def like_tag(ptd: str | os.PathLike[str]) -> str:
    """The tag a ``like`` file gives the keys it holds: its name without ``.ptd``."""
    name = os.path.basename(os.fspath(ptd))
    return name[: -len(".ptd")] if name.endswith(".ptd") else name


def tags_and_order(program, like: Sequence[str], tag, problems: list[str]
                   ) -> tuple[dict[str, list[str]], list[str], dict[str, Located]]:
    """``{tag: [key, ...]}`` in upstream's order, the keys of ``like`` files that
    are no program FQN (a delegate's named data), in file order, and where each
    key of the ``like`` files lies (``{key: (path, offset, bytes)}``). Without
    ``like``, ``tag`` (a str, ``{fqn: tag}`` or ``fqn -> tag``) gives each key's tag."""
    from ..format.reader import read_artifact

    located: dict[str, Located] = {}
    if like:
        out: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        foreign: list[str] = []
        for ptd in like:
            art = read_artifact(os.fspath(ptd))
            if art.kind != "ptd":
                problems.append(f"like: {ptd} is a .pte, not a .ptd")
                continue
            keys = out.setdefault(like_tag(ptd), [])
            segments = {s.index: s for s in art.segments}
            for entry in art.named:
                if entry.key in owner:
                    problems.append(f"like: key {entry.key!r} is in both {owner[entry.key]} and {ptd}")
                    continue
                owner[entry.key] = str(ptd)
                segment = segments.get(entry.segment_index)
                if segment is not None:
                    located[entry.key] = (os.fspath(ptd), segment.start, segment.nbytes)
                if entry.key not in program.keys:
                    foreign.append(entry.key)
                keys.append(entry.key)
        for fqn in program.keys:
            if fqn not in owner:
                problems.append(f"key {fqn!r} of {program.path} is in none of the like= files")
        return out, foreign, located
    out = {}
    for fqn in program.keys:
        t = tag if isinstance(tag, str) else (tag(fqn) if callable(tag) else tag.get(fqn))
        if not isinstance(t, str):
            problems.append(f"key {fqn!r}: no tag for it (tag= gave {t!r})")
            continue
        out.setdefault(t, []).append(fqn)
    return out, [], located


def describe_layout(layout) -> str:
    """``FLOAT[8, 32] dim order [0, 1]`` of an upstream ``TensorLayout``."""
    from executorch.exir.scalar_type import ScalarType

    try:
        name = ScalarType(int(layout.scalar_type)).name
    except ValueError:
        name = f"ScalarType {int(layout.scalar_type)}"
    return f"{name}{list(layout.sizes)} dim order {list(layout.dim_order)}"


def _scalar_of(dtype) -> int | None:
    from executorch.exir.tensor import scalar_type_enum

    try:
        return int(scalar_type_enum(dtype))
    except Exception:  # noqa: BLE001 - a dtype executorch has no ScalarType for is a mismatch
        return None


def check_keys(program, ckpt: Checkpoint, key_map: KeyMap, allow_extra: bool, problems: list[str],
               also_used: Collection[str] = frozenset(), keep: Collection[str] = frozenset(),
               located: Mapping[str, Located] | None = None) -> dict[str, str]:
    """``{fqn: checkpoint key}`` of every program key not in ``keep``; every
    problem appended to ``problems``, one line each, naming the option that
    resolves it (module docstring). ``located``: where the like= files hold each key."""
    from executorch.exir.scalar_type import ScalarType

    located = located or {}
    lookup = mapper(key_map)
    chosen: dict[str, str] = {}
    missing: list[tuple[int, str, Any]] = []
    for fqn, layout in program.keys.items():
        if fqn in keep:
            continue
        key = lookup(fqn)
        if key is None or key not in ckpt.entries:
            via = "" if key == fqn else f" (looked up as {key!r})"
            missing.append((len(problems), fqn, layout))
            problems.append(f"missing: {fqn!r}{via} ({describe_layout(layout)}) is not in {ckpt.path}")
            continue
        chosen[fqn] = key
        entry = ckpt.entries[key]
        named = f"{fqn!r}" if key == fqn else f"{fqn!r} (checkpoint key {key!r})"
        scalar = _scalar_of(entry.dtype)
        if scalar != int(layout.scalar_type):
            have = ScalarType(scalar).name if scalar is not None else str(entry.dtype)
            problems.append(f"dtype: {named} is {have} ({entry.dtype}) in the checkpoint, the program expects "
                            f"{describe_layout(layout).split('[')[0]}")
        if list(entry.shape) != [int(s) for s in layout.sizes]:
            problems.append(f"shape: {named} is {list(entry.shape)} in the checkpoint, the program expects "
                            f"{[int(s) for s in layout.sizes]}")
        elif list(entry.dim_order) != [int(d) for d in layout.dim_order]:
            problems.append(f"dim order: {named} is {list(entry.dim_order)} in the checkpoint, the program "
                            f"expects {[int(d) for d in layout.dim_order]}")
    used = set(chosen.values()) | set(also_used)
    # A key whose tensor is the very memory of a used key's (tied weights saved twice) is no extra.
    used_roots = {ckpt.aliases[k] for k in used if k in ckpt.aliases}
    extra = [k for k in ckpt.entries if k not in used and not (k in ckpt.aliases and ckpt.aliases[k] in used_roots)]
    none_found = len(missing) > 1 and not chosen  # a checkpoint of another model, or under other names
    for at, fqn, layout in missing:
        problems[at] += _missing_hint(fqn, layout, ckpt, extra, located, _rule_of(key_map, fqn),
                                      twins=not none_found)
    if none_found:
        problems.insert(missing[0][0], _none_found(lookup, [fqn for _, fqn, _ in missing], ckpt, key_map))
    if extra and not allow_extra:
        shown = ", ".join(repr(k) for k in extra[:50])
        more = f" and {len(extra) - 50} more" if len(extra) > 50 else ""
        problems.append(f"extra: {len(extra)} checkpoint key(s) are not weights of the program: {shown}{more} "
                        "(allow_extra=True / --allow-extra to ignore them)")
    return chosen


def _none_found(lookup: Callable[[str], str | None], fqns: Sequence[str], ckpt: Checkpoint,
                key_map: KeyMap) -> str:
    """The first problem when none of the program's keys ``fqns`` is in ``ckpt``: one
    map of prefixes that finds every one (:func:`_prefix_map`), else a checkpoint of
    another model, with the first names of both."""
    looked = " (looked up through key_map / --map)" if key_map is not None else ""
    head = f"none of the program's {len(fqns)} keys is in {ckpt.path}{looked}"
    found = _prefix_map([lookup(f) or f for f in fqns], ckpt.entries)
    if found is not None:
        old, new = found
        return (f"{head}, but each is there under another prefix: key_map={{{old!r}: {new!r}}} / "
                f"--map {old}={new}")
    return (f"{head}: a checkpoint of another model? (the program's keys: {_first(fqns)}; the checkpoint's: "
            f"{_first(list(ckpt.entries)) or 'none'})")


def _first(names: Sequence[str], n: int = 3) -> str:
    """The first ``n`` of ``names``, quoted, and ``...`` if there are more."""
    return ", ".join([repr(k) for k in names[:n]] + ["..."] * (len(names) > n))


def _prefix_map(names: Sequence[str], keys: Collection[str], tries: int = 64) -> tuple[str, str] | None:
    """``(old, new)``: one prefix rewrite (``new + name[len(old):]``) that turns every
    one of ``names`` into one of ``keys`` (``model.layers.0.w`` -> ``layers.0.w``,
    ``0.weight`` -> ``other.0.weight``), or None. Candidates come from the keys that end
    like ``names[0]`` (at most ``tries`` of them), each checked against every name:
    work linear in the number of keys and names."""
    first = names[0]
    tails = [first] + [first[i + 1:] for i, c in enumerate(first) if c == "."]  # longest first
    candidates: dict[tuple[str, str], None] = {}
    for key in keys:
        if len(candidates) >= tries:
            break
        for tail in tails:  # the longest shared tail: the smallest rewrite
            if key.endswith(tail) and (len(key) == len(tail) or key[-len(tail) - 1] == "."):
                candidates.setdefault((first[: len(first) - len(tail)], key[: len(key) - len(tail)]), None)
                break
    for old, new in candidates:
        if old != new and all(n.startswith(old) and new + n[len(old):] in keys for n in names):
            return old, new
    return None


def _rule_of(key_map: KeyMap, fqn: str) -> str | None:
    """The user's map entry that renamed ``fqn`` (``{old!r}: {new!r}``), ``"key_map"``
    for a callable that renamed it, None when ``fqn`` was looked up unchanged."""
    key = mapper(key_map)(fqn)
    if key == fqn:
        return None
    if callable(key_map) or key_map is None:
        return "key_map"
    old = next(o for o in key_map if fqn.startswith(o))
    return f"key_map={{{old!r}: {key_map[old]!r}}} / --map {old}={key_map[old]}"


def _missing_hint(fqn: str, layout, ckpt: Checkpoint, extra: Sequence[str], located: Mapping[str, Located],
                  rule: str | None = None, twins: bool = True) -> str:
    """What resolves a missing key: the user's map that sent it to a key the
    checkpoint lacks (``rule``), else (with ``twins``: some program key was found)
    the unused checkpoint key of its dtype and shape (``key_map``; never the key
    itself), else the like= file that holds it (``keep``); else nothing."""
    sizes = [int(s) for s in layout.sizes]
    twins_of = [k for k in extra if twins and k != fqn and list(ckpt.entries[k].shape) == sizes
                and _scalar_of(ckpt.entries[k].dtype) == int(layout.scalar_type)]
    if rule is not None:
        own = (f"; {ckpt.path} holds {fqn!r} under the program's own name" if fqn in ckpt.entries else "")
        return (f"; the map is the problem: {rule} renamed it to a key {ckpt.path} lacks{own}; "
                "fix or drop that map")
    if len(twins_of) == 1:
        return (f"; its checkpoint key {twins_of[0]!r} has its dtype and shape (a tied weight saved under its "
                f"other name?): key_map={{{fqn!r}: {twins_of[0]!r}}} / --map {fqn}={twins_of[0]}")
    if fqn in located:
        return (f"; {located[fqn][0]} holds it (a buffer no checkpoint saves, such as a non-persistent one?): "
                f"keep=[{fqn!r}] / --keep {fqn} copies its exported bytes unchanged")
    return ""
