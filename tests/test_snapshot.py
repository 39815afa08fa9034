"""The blocking part of a save: what `snapshot.copy` hands the writer (the HostPool and ByteBudget
themselves: test_hostmem.py)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ckpt_callbacks as cc
from ckpt_callbacks import hostmem, snapshot


def _copies(tree, pool=None, budget=None):
    snap = snapshot.plan(tree)
    items = []
    snapshot.copy(snap, items.append, budget, pool)
    assert items[-1] is None
    out = {}
    for it in items[:-1]:
        if it[0] == "packed":
            out[it[1]] = it[2]
        else:
            out[it[1].leaf] = it[1].data
    return snap, out


def test_cpu_state_within_the_pool_limit_is_copied_and_larger_or_budgeted_state_is_viewed():
    x = jax.device_put(jnp.arange(1 << 19, dtype=jnp.float32))   # 2 MiB: packed
    tree = {"x": x, "n": np.ones(4), "s": jnp.float32(1)}
    snap, out = _copies(tree, hostmem.HostPool())
    assert snap.pooled
    assert not any(np.shares_memory(v, np.asarray(x)) for v in out.values())
    np.testing.assert_array_equal(out[2], np.asarray(x))

    snap, out = _copies(tree, hostmem.HostPool(max_bytes=1 << 20))   # over the limit: a view
    assert not snap.pooled and np.shares_memory(out[2], np.asarray(x))

    budget = hostmem.ByteBudget(1 << 20)        # the budget wins too (x alone: nothing releases here)
    snap, out = _copies({"x": x}, hostmem.HostPool(), budget)
    assert not snap.pooled and np.shares_memory(out[0], np.asarray(x))

    snap, out = _copies(tree)                                            # no pool: views
    assert not snap.pooled and np.shares_memory(out[2], np.asarray(x))


def test_leaves_up_to_4_mib_held_whole_are_packed_and_larger_or_cross_process_ones_are_zarr_arrays():
    assert snapshot.PACK_MAX_BYTES == 4 << 20
    n = snapshot.PACK_MAX_BYTES // 4
    mesh = jax.make_mesh((8,), ("a",))
    sharded = jax.device_put(jnp.zeros(n, jnp.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a")))
    snap = snapshot.plan({"at": np.zeros(n, np.float32), "above": np.zeros(n + 1, np.float32),
                          "sharded": sharded, "small": np.zeros(3)})
    kinds = {r["p"][0][1]: r["k"] for r in snap.records}
    assert kinds == {"at": "packed", "above": "array", "sharded": "packed", "small": "packed"}
    # the caller's threshold wins (and only this process's whole leaves are ever packed)
    kinds = {r["p"][0][1]: r["k"] for r in snapshot.plan({"at": np.zeros(n, np.float32)}, pack_max_bytes=1 << 20).records}
    assert kinds == {"at": "array"}


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned host", "on device"])
def test_off_cpu_a_packed_leaf_is_an_asynchronous_copy_the_writer_reads(monkeypatch, pinned):
    """A packed leaf on an accelerator is not transferred on the caller's thread (that would block
    the training step for the whole device-to-host copy): `copy` hands the writer a copy
    dispatched asynchronously, into pinned host memory (or on the device, where it has no pinned
    host memory), which stays valid when the step donates the original."""
    monkeypatch.setattr(snapshot, "_on_cpu", lambda x: False)
    monkeypatch.setattr(snapshot, "_has_pinned_host", lambda d: pinned)
    x = jax.device_put(jnp.arange(1 << 18, dtype=jnp.float32))   # 1 MiB: packed
    expected = np.asarray(x).copy()
    n = np.ones(3)
    snap, out = _copies({"n": n, "x": x})   # leaves 0 and 1
    assert [r["k"] for r in snap.records] == ["packed", "packed"] and isinstance(out[1], jax.Array)
    assert out[1].sharding.memory_kind == ("pinned_host" if pinned else x.sharding.memory_kind)
    assert out[1].unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)   # the original donated
    np.testing.assert_array_equal(np.asarray(out[1]), expected)
    assert isinstance(out[0], np.ndarray) and not np.shares_memory(out[0], n)   # numpy: copied at once


def test_a_deleted_jax_array_is_an_invalid_tree_naming_the_key_path(ckdir):
    import jax.numpy as jnp
    gone = jnp.ones(3)
    gone.delete()   # as a donating step leaves it
    with cc.CheckpointManager(ckdir) as m:
        with pytest.raises(cc.InvalidTreeError, match=r"at \['opt'\]\[1\]: this jax.Array was deleted"):
            m.save(1, {"opt": [jnp.zeros(2), gone]})
        assert m.all_steps() == []


def test_a_traced_value_is_an_invalid_tree_naming_the_key_path(ckdir):
    """save() called inside jit/grad/vmap raised jax's ConcretizationTypeError (from `is_deleted`)."""
    import jax
    import jax.numpy as jnp
    with cc.CheckpointManager(ckdir) as m:
        for transform in (jax.jit, jax.grad, jax.vmap):
            with pytest.raises(cc.InvalidTreeError, match=r"at \['opt'\]\[1\]: a traced value .*inside jax.jit"):
                transform(lambda x: (m.save(1, {"opt": [np.zeros(2), x]}), x.sum())[1])(jnp.ones(2))
        assert m.all_steps() == []


@pytest.mark.parametrize("leaf,message", [
    (np.ma.masked_array([1.0, 2.0, -999.0], mask=[0, 0, 1]), "a numpy masked array would lose its mask"),
    (np.zeros((1,) * 33, np.float32), "33 dimensions; the format holds at most 32"),            # packed
    (np.zeros((2,) * 20 + (1,) * 13, np.float32), "33 dimensions; the format holds at most 32"),  # a zarr array
    ("\ud800", "the str '\\\\ud800' is not valid Unicode"),   # (a lone surrogate: failed in the writer)
])
def test_leaves_the_format_cannot_hold_as_they_are_are_refused_at_save_naming_the_key_path(ckdir, leaf, message):
    """A masked array was saved without its mask (restored with the masked values); a leaf of more
    than 32 dimensions (numpy 2 allows 64) committed a step that no restore could read, or failed
    in the writer without a key path."""
    with cc.CheckpointManager(ckdir) as m:
        with pytest.raises(cc.InvalidTreeError, match=r"at \['opt'\]\[1\]: " + message):
            m.save(1, {"opt": [np.zeros(2), leaf]})
        assert m.all_steps() == []


@pytest.mark.parametrize("leaf,message", [
    (np.zeros(3, [("a", "<f4"), ("b", "<i4")]),   # numpy names it "void64"
     r"a structured dtype \[\('a', '<f4'\), \('b', '<i4'\)\].*Fix: save each field as a leaf of its own"),
    (np.zeros(2, [("a", "<f4")])[0], r"a structured dtype \[\('a', '<f4'\)\]"),   # a numpy scalar of one
    (np.array(["ab", "c"]), r"dtype <U2 \(str64\) cannot be saved.*Fix: save the values as Python str or bytes"),
    (jax.grad(lambda p: p["w"].sum(), allow_int=True)({"w": np.ones(2), "n": np.int32(3)})["n"],   # was: "save
     r"dtype float0 \(the gradient .*holds no values\).*Fix: leave it out, or save None"),      # each field"
    (np.array(["2020-01-01"], "datetime64[D]"),
     r"dtype datetime64\[D\] cannot be saved; the format can hold .*bfloat16, bool, .*, int64, .*Fix: convert it"),
])
def test_a_dtype_the_format_cannot_hold_is_refused_saying_what_it_is_and_how_to_save_it(ckdir, leaf, message):
    """A structured dtype was refused as "dtype void64 cannot be saved": numpy's name for it, with
    neither the fields the user wrote, nor what the format holds, nor how to save it instead."""
    with cc.CheckpointManager(ckdir) as m:
        with pytest.raises(cc.InvalidTreeError, match=r"at \['opt'\]\[1\]: " + message):
            m.save(1, {"opt": [np.zeros(2), leaf]})
        assert m.all_steps() == []


def test_the_structure_digest_changes_with_the_files_a_plan_writes_and_only_with_them(devices):
    """What processes compare before a save (`agreement.agree`): equal where every
    file would hold the same bytes' places, different where a key, shape, dtype or an array's
    sharding differs (processes then wrote into each other's arrays)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    big = np.zeros((1024, 1280), np.float32)   # above PACK_MAX_BYTES: a zarr array
    rows, cols = NamedSharding(mesh, P("a", None)), NamedSharding(mesh, P(None, "b"))

    def digest(tree):
        return snapshot.structure(snapshot.plan(tree))[0]
    base = {"n": np.float32(1), "v": np.ones(3, np.float32), "s": 3, "w": jax.device_put(big, rows)}
    same = [{**base, "n": np.array(1, np.float32)},          # a numpy scalar or a 0-d array: the same bytes
            {**base, "v": jnp.ones(3, jnp.float32)},         # a packed value from numpy or jax
            {**base, "s": 4}]                                # an inline scalar's value (process 0's is saved)
    other = [{**base, "extra": np.ones(3)}, {**base, "v": np.ones(4, np.float32)},
             {**base, "v": np.ones(3, np.float64)}, {**base, "w": jax.device_put(big, cols)}]
    assert all(digest(t) == digest(base) for t in same)
    assert len({digest(base)} | {digest(t) for t in other}) == 1 + len(other)
    lines = snapshot.structure(snapshot.plan(other[0]))[1]
    assert lines[0].startswith("['extra']: packed float64[3]")
