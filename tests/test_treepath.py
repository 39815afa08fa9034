"""Typed key paths and skeletons, property-tested over random nested trees."""

import collections

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ckpt_callbacks import treepath
from ckpt_callbacks.errors import IncompatibleCheckpointError

NT = collections.namedtuple("NT", ["a", "b"])

leaves = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3), st.floats(allow_nan=False),
                   st.builds(lambda n: np.arange(n), st.integers(0, 3)))
trees = st.recursive(leaves, lambda kids: st.one_of(
    st.dictionaries(st.text(max_size=4), kids, max_size=4),
    st.dictionaries(st.integers(-3, 3), kids, max_size=4),
    st.lists(kids, max_size=3),
    st.tuples(kids, kids),
    st.builds(NT, kids, kids)), max_leaves=15)


def _norm(x):
    if isinstance(x, NT):
        return {"a": _norm(x.a), "b": _norm(x.b)}
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_norm(v) for v in x)
    if isinstance(x, np.ndarray):
        return ("arr", x.tolist())
    return x


@settings(max_examples=300, deadline=None)
@given(tree=trees)
def test_flatten_rebuild_roundtrip_and_jax_order(tree):
    flat = treepath.flatten(tree)
    rebuilt = treepath.rebuild(flat.skeleton, flat.leaves)
    assert _norm(rebuilt) == _norm(tree)            # NamedTuples come back as dicts of fields
    jl = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
    assert len(jl) == len(flat.leaves) and all(a is b for a, b in zip(jl, flat.leaves))
    assert treepath.match(flat.paths, flat.paths) == list(range(len(flat.paths)))


def test_int_and_str_keys_are_different_paths():
    a = treepath.flatten({1: 0}).paths
    b = treepath.flatten({"1": 0}).paths
    assert a != b
    with pytest.raises(IncompatibleCheckpointError, match=r"\['1'\]"):
        treepath.match(a, b)


@pytest.mark.parametrize("tree, match", [
    ({"a": {2**70: 0}}, r"at \['a'\]: dict key 1180591620717411303424 does not fit in 64 bits"),
    ({"a": {-2**63 - 1: 0}}, "does not fit in 64 bits"),
    ({"a": [{1: 0, "b": 1}]}, r"at \['a'\]\[0\]: a dict with keys of types int, str"),
    ({"a": {"\udc80": 0}}, r"at \['a'\]: dict key '\\udc80' is not valid Unicode"),   # failed in the writer
])
def test_keys_that_cannot_be_written_are_refused_naming_the_path(tree, match):
    with pytest.raises(TypeError, match=match):
        treepath.flatten(tree)
    assert [p for p in treepath.flatten({2**64 - 1: 0, -2**63: 1}).paths] == [(("d", -2**63),), (("d", 2**64 - 1),)]


def test_keystr():
    flat = treepath.flatten({"params": [NT(1, {"k": 2})]})
    assert flat.texts == ["['params'][0].a", "['params'][0].b['k']"]


def test_containers_nested_beyond_the_limit_are_refused_and_up_to_it_kept():
    """Deeper trees failed in the writer (msgpack's nesting limit) or raised a raw RecursionError."""
    def nest(depth):
        t = 0
        for i in range(depth):
            t = {"k": t} if i % 2 else [t]
        return t
    assert len(treepath.flatten(nest(treepath.MAX_DEPTH)).paths[0]) == treepath.MAX_DEPTH
    for depth in (treepath.MAX_DEPTH + 1, 5000):
        with pytest.raises(TypeError, match=f"nested more than {treepath.MAX_DEPTH} levels deep"):
            treepath.flatten(nest(depth))


def test_a_container_holding_itself_is_refused_and_the_process_saves_on(tmp_path):
    """A dict holding itself (or a list, through another container): jax recursed into it without
    end, and its RecursionError left the interpreter failing every later save with RecursionError,
    to a new manager and a new directory too; a restore target like it raised jax's SystemError."""
    import ckpt_callbacks as cc
    loop = {"w": np.ones(2)}
    loop["self"] = loop
    ring = [1]
    ring.append({"back": ring})
    with cc.CheckpointManager(str(tmp_path / "a")) as m:
        for bad in (loop, ring):
            with pytest.raises(cc.InvalidTreeError, match=f"nested more than {treepath.MAX_DEPTH} levels deep"):
                m.save(1, bad)
        m.save(1, {"self": {"w": np.ones(2)}})
    r = cc.CheckpointManager(str(tmp_path / "a"), read_only=True)
    with pytest.raises(cc.InvalidTreeError, match=f"nested more than {treepath.MAX_DEPTH} levels deep"):
        r.restore(1, target=loop)
    with cc.CheckpointManager(str(tmp_path / "b")) as m:   # and everything else still works
        m.save(2, {"x": np.arange(3)})
    assert cc.CheckpointManager(str(tmp_path / "b"), read_only=True).restore(2)["x"].tolist() == [0, 1, 2]


class _TwoUnder:
    """A registered node whose flatten_with_keys names both children alike (the class's `keys`)."""

    keys = ()

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    _TwoUnder, lambda n: (tuple(zip(n.keys, (n.a, n.b))), None), lambda _, kids: _TwoUnder(*kids),
    flatten_func=lambda n: ((n.a, n.b), None))


@pytest.mark.parametrize("keys", [(jax.tree_util.GetAttrKey("w"), jax.tree_util.GetAttrKey("w")),
                                  (jax.tree_util.GetAttrKey("w"), jax.tree_util.DictKey("w"))])
def test_a_node_naming_two_children_alike_is_refused_at_save_and_as_a_target(tmp_path, keys, monkeypatch):
    """It saved, and then `restore()` gave back one of the two leaves (the other silently lost),
    while a restore onto the same tree said the checkpoint lacked the path."""
    import ckpt_callbacks as cc
    monkeypatch.setattr(_TwoUnder, "keys", keys)
    tree = {"d": _TwoUnder(np.ones(2), np.zeros(2))}
    with pytest.raises(TypeError, match=r"at \['d'\]: _TwoUnder names two children \.w and (\.w|\['w'\])"):
        treepath.flatten(tree)
    with cc.CheckpointManager(str(tmp_path / "c")) as m:
        with pytest.raises(cc.InvalidTreeError, match="names two children"):
            m.save(1, tree)
        m.save(1, {"d": {"w": np.ones(2)}})
        with pytest.raises(cc.InvalidTreeError, match="names two children"):
            m.restore(1, target=tree)
        assert m.restore(1)["d"]["w"].tolist() == [1.0, 1.0]
