"""Typed key paths and tree skeletons: how a pytree's structure is written down and rebuilt.

Example::

    from ckpt_callbacks import treepath
    flat = treepath.flatten({"a": [1, None], "b": {}})
    [treepath.keystr(p) for p in flat.paths]   # ["['a'][0]", "['a'][1]"]
    treepath.rebuild(flat.skeleton, ["x", None])   # {'a': ['x', None], 'b': {}}

A key path is a tuple of entries, each a 2-list ``[kind, key]``: ``"d"`` a dict key (str or int,
its type kept), ``"i"`` a list/tuple index, ``"a"`` an attribute (NamedTuple, dataclass, flax
struct), ``"f"`` a flattened index (other registered nodes). Key paths are names in the manifest
only; no file name is ever derived from them, so no key can escape the step directory.

The skeleton records container kinds so that ``restore(target=None)`` rebuilds dicts, lists,
tuples, empty containers and Nones. NamedTuples and other registered nodes come back as dicts of
their fields (rebuilding a class from a checkpoint would run code named by the file; pass a target
to get the original classes). ``None`` is kept as a leaf of kind "none" so that it round-trips.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import tree_util as jtu

from .errors import IncompatibleCheckpointError

__all__ = ["KeyPath", "Flat", "flatten", "rebuild", "keystr", "match", "class_changes"]

KeyPath = tuple  # tuple of (kind, key) pairs


MAX_DEPTH = 100   # containers nested deeper are refused (msgpack nests the skeleton ~3 levels per level, up to 511)


def encodable(text: str) -> bool:
    """Whether a str can be stored (UTF-8, as msgpack writes it): not with a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _entry(k) -> tuple:
    if isinstance(k, jtu.DictKey):
        key = k.key
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"dict key {key!r} of type {type(key).__name__}: only str and int keys can be saved")
        if isinstance(key, str) and not encodable(key):
            raise TypeError(f"dict key {key!r} is not valid Unicode (a lone surrogate): it cannot be saved")
        if isinstance(key, int) and not -2**63 <= key < 2**64:
            raise TypeError(f"dict key {key} does not fit in 64 bits: only int keys of 64 bits or fewer can be saved")
        return ("d", key)
    if isinstance(k, jtu.SequenceKey):
        return ("i", k.idx)
    if isinstance(k, jtu.GetAttrKey):
        return ("a", k.name)
    if isinstance(k, jtu.FlattenedIndexKey):
        return ("f", k.key)
    raise TypeError(f"unsupported key path entry {k!r}")


def keystr(path: KeyPath) -> str:
    """Human form of a typed key path, e.g. ``['params'][0].kernel`` (``<root>`` for the root)."""
    out = []
    for kind, key in path:
        if kind == "d":
            out.append(f"[{key!r}]")
        elif kind == "a":
            out.append(f".{key}")
        else:
            out.append(f"[{key}]")
    return "".join(out) or "<root>"


@dataclasses.dataclass(frozen=True)
class Flat:
    """A flattened tree: parallel lists of typed paths and leaves, plus the skeleton (msgpack-able)."""

    paths: list
    leaves: list
    skeleton: Any

    @property
    def texts(self) -> list[str]:
        return [keystr(p) for p in self.paths]


# types jax always flattens as leaves (exact types, not subclasses: a subclass may be a registered
# node), and jax.Arrays: told apart without asking jax to flatten them (~15 us a leaf)
_LEAF_TYPES = frozenset({np.ndarray, int, float, bool, complex, str, bytes})


def _children(node):
    """One level of a pytree node: list of (entry, child) or None when `node` is a leaf."""
    if node is None or type(node) in _LEAF_TYPES or isinstance(node, jax.Array):
        return None
    asked = []   # only `node` itself is opened: a child that is `node` again (a dict holding itself)
    # is a leaf here, and `flatten` refuses the nesting by depth; with `x is not node` jax recursed
    # into it without end, and its RecursionError left every later call of this process failing

    def is_leaf(x):
        asked.append(x)
        return len(asked) > 1

    try:
        kids, treedef = jtu.tree_flatten_with_path(node, is_leaf=is_leaf)
    except (ValueError, TypeError):
        types = sorted({type(k).__name__ for k in node}) if isinstance(node, dict) else []
        if len(types) > 1:   # jax sorts a dict's keys: it cannot sort mixed ones
            raise TypeError(f"a dict with keys of types {', '.join(types)}: jax sorts a dict's keys, "
                            f"so one dict holds keys of one type") from None
        raise
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
        return None  # a leaf: the tree is just itself
    return [(_entry(kp[0]), child) for kp, child in kids]


def _kind(node) -> tuple[str, str]:
    if isinstance(node, dict):
        return "dict", ""
    if isinstance(node, list):
        return "list", ""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return "namedtuple", type(node).__qualname__
    if isinstance(node, tuple):
        return "tuple", ""
    return "node", f"{type(node).__module__}.{type(node).__qualname__}"


def flatten(tree) -> Flat:
    """Flatten `tree` into typed key paths, leaves (``None`` included) and a skeleton.

    Raises TypeError naming the key path for keys that cannot be written (non str/int dict keys).
    """
    paths: list = []
    leaves: list = []

    def walk(node, path):
        if node is None:
            paths.append(path)
            leaves.append(None)
            return {"l": len(leaves) - 1}
        try:
            kids = _children(node)
        except TypeError as e:
            raise TypeError(f"at {keystr(path)}: {e}") from None
        if kids is None:
            paths.append(path)
            leaves.append(node)
            return {"l": len(leaves) - 1}
        if len(path) >= MAX_DEPTH:
            raise TypeError(f"at {keystr(path)[:120]}...: containers nested more than {MAX_DEPTH} levels deep "
                            f"cannot be saved")
        kind, name = _kind(node)
        if kind == "node":   # (dicts, sequences and NamedTuples cannot repeat a key)
            _unique_keys(node, kids, path)
        return {"t": kind, "n": name, "c": [[list(e), walk(child, path + (e,))] for e, child in kids]}

    skeleton = walk(tree, ())
    return Flat(paths, leaves, skeleton)


def _unique_keys(node, kids: list, path) -> None:
    """Refuse a registered node that names two children alike (its ``flatten_with_keys`` gives
    the same key twice, or ``.w`` and ``['w']``): a checkpoint names leaves by key path, so a
    restore onto such a target found one of them missing, and `rebuild` (``target=None``) kept
    one of the two, silently."""
    seen: dict = {}
    for e, _ in kids:
        if (other := seen.setdefault(e[1], e)) is not e:
            raise TypeError(f"at {keystr(path)}: {type(node).__qualname__} names two children "
                            f"{keystr((other,))} and {keystr((e,))}: a checkpoint restores leaves by their "
                            f"key paths, so one of them would be lost. Fix: give each child its own key in "
                            f"the class's flatten_with_keys")


def rebuild(skeleton, leaves: list):
    """Rebuild containers from a skeleton: dict/list/tuple as saved, other nodes as dicts of fields."""
    def walk(node):
        if "l" in node:
            return leaves[node["l"]]
        kids = [(tuple(e), walk(c)) for e, c in node["c"]]
        kind = node["t"]
        if kind == "list":
            return [v for _, v in kids]
        if kind == "tuple":
            return tuple(v for _, v in kids)
        return {e[1]: v for e, v in kids}
    return walk(skeleton)


def match(saved_paths: list, target_paths: list, partial: bool = False) -> list[int]:
    """For each target path, the index of the saved leaf with the same typed path.

    Raises IncompatibleCheckpointError listing every path missing on either side (with `partial`,
    only the target's: saved leaves the target lacks are left unread).
    """
    index = {tuple(map(tuple, p)): i for i, p in enumerate(saved_paths)}
    order, missing = [], []
    for p in target_paths:
        i = index.pop(tuple(map(tuple, p)), None)
        if i is None:
            missing.append(p)
        order.append(i)
    if partial:
        index = {}
    if missing or index:
        missing = [tuple(map(tuple, p)) for p in missing]
        extra = [tuple(map(tuple, saved_paths[i])) for i in sorted(index.values())]
        mismatches = [(keystr(p), "absent", "present") for p in missing]
        mismatches += [(keystr(p), "present", "absent") for p in extra]
        lines = _mismatch_lines(missing, extra)
        more = f"\n  ... and {len(lines) - 50} more" if len(lines) > 50 else ""
        where = f"{len(lines)} place(s)" + (f" ({len(mismatches)} key paths)" if len(mismatches) != len(lines) else "")
        raise IncompatibleCheckpointError(
            f"the restore target's structure differs from the checkpoint's in {where}:\n"
            + "\n".join(lines[:50]) + f"{more}\nFix: build the target with the same structure as the saved "
            f"tree, or pass target=None to get the saved tree as host arrays.", mismatches)
    return order


_KEY_KINDS = {"d": "a dict key", "i": "a list/tuple index", "a": "a field", "f": "a field"}


def _mismatch_lines(missing: list, extra: list) -> list[str]:
    """One line per difference between the target's leaf paths that the checkpoint lacks
    (`missing`) and the checkpoint's that the target lacks (`extra`). Said as what it is where
    that is plain: a leaf on one side where the other has a container (e.g. None in the target,
    which stands in for one saved leaf, where a tuple was saved), and the same path under
    different kinds of key (a dict with int keys where a list was saved: both print ``[0]``)."""
    lines, told_missing, told_extra = [], set(), set()

    def below_of(paths):   # every strict prefix of these paths -> the paths under it
        out: dict = {}
        for q in paths:
            for n in range(len(q)):
                out.setdefault(q[:n], []).append(q)
        return out

    # a leaf on one side where the other has a container: (leaves of this side, the other side's
    # leaves under each path, which set each belongs to, how the line says it)
    for mine, others, told_mine, told_others, say in (
            (missing, below_of(extra), told_missing, told_extra,
             "holds a container of {n} leaves there, the target a single leaf (a target leaf, None too, "
             "stands in for one saved leaf)"),
            (extra, below_of(missing), told_extra, told_missing,
             "holds a single leaf there, the target a container of {n} leaves")):
        for p in mine:
            below = others.get(p)
            if below:
                told_mine.add(p)
                told_others.update(below)
                lines.append(f"  {keystr(p)}: the checkpoint " + say.format(n=len(below)))
    by_text = {}
    for q in extra:
        if q not in told_extra:
            by_text.setdefault(keystr(q), q)
    for p in missing:
        q = by_text.get(keystr(p)) if p not in told_missing else None
        if q is None or q in told_extra or len(q) != len(p):   # (same text, other depth: a key with "][" in it)
            continue
        j = next(j for j, (a, b) in enumerate(zip(p, q)) if a != b)
        told_missing.add(p)
        told_extra.add(q)
        lines.append(f"  {keystr(p)}: both have it, under other kinds of key at {keystr(p[:j])}: the checkpoint "
                     f"{_KEY_KINDS.get(q[j][0], q[j][0])}, the target {_KEY_KINDS.get(p[j][0], p[j][0])} "
                     f"(e.g. a dict with int keys where a list was saved)")
    lines += [f"  {keystr(p)}: checkpoint has it: no, target has it: yes" for p in missing if p not in told_missing]
    lines += [f"  {keystr(q)}: checkpoint has it: yes, target has it: no" for q in extra if q not in told_extra]
    return lines


def class_changes(saved, target, path: KeyPath = ()) -> list[tuple[str, str, str]]:
    """``(key path, saved class, target class)`` for each container at the same path of both
    skeletons whose class names differ (NamedTuples and other registered nodes: an optax
    `ScaleByAdamState` restored into a `ScaleByBeliefState` has the same fields, so `match`
    accepts it). Names compare without their module: a script's `__main__.State` is `State`."""
    if "c" not in saved or "c" not in target:
        return []
    a, b = saved.get("n") or "", target.get("n") or ""
    out = [(keystr(path), a, b)] if a and b and a.rsplit(".", 1)[-1] != b.rsplit(".", 1)[-1] else []
    kids = {tuple(e): child for e, child in target["c"]}
    for e, child in saved["c"]:
        if (other := kids.get(tuple(e))) is not None:
            out += class_changes(child, other, path + (tuple(e),))
    return out


def is_prng_key(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
