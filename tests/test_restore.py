"""Engine core: save/restore of every leaf kind, resharding, partial reads, checksums, errors."""

import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt_callbacks as cc
from ckpt_callbacks import chunkread, localfs
from ckpt_callbacks import restore as restore_mod
from ckpt_callbacks.storage import open_store
from helpers import DTYPES, Pair, State, assert_tree_equal, bytes_read, np_dtype, objects_kept_by_restores, random_array


def save(d, tree, step=1, **kw):
    with cc.CheckpointManager(d, async_save=False, **kw) as m:
        assert m.save(step, tree)
    return d


def mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("a", "b"))


def shardings():
    return {
        "4x2": NamedSharding(mesh((4, 2)), P("a", "b")),
        "2x4": NamedSharding(mesh((2, 4)), P("a", "b")),
        "8x1": NamedSharding(mesh((8, 1)), P("a", None)),
        "partial": NamedSharding(mesh((4, 2)), P(None, "b")),   # replicated over a
        "replicated": NamedSharding(mesh((4, 2)), P()),
        "single": SingleDeviceSharding(jax.devices()[3]),
    }


def test_every_leaf_kind_roundtrips_without_target(ckdir):
    tree = {
        "np": np.arange(12, dtype=np.int32).reshape(3, 4),
        "npscalar": np.float32(2.5),
        "npfloat64": np.float64(0.1),   # a subclass of float: still a numpy scalar after the round trip
        "py": [1, 2.5, True, "s", b"b", None, -(2**63), 2**64 - 1],
        "empty": {"d": {}, "l": [], "t": ()},
        "nested": {"x": {"y": (np.ones(2),)}},
        "big": np.arange(600_000, dtype=np.float32),     # stored as a zarr array, not packed
    }
    save(ckdir, tree)
    out = cc.CheckpointManager(ckdir, read_only=True).restore()
    assert_tree_equal(out, tree)
    assert isinstance(out["npscalar"], np.float32)
    assert isinstance(out["npfloat64"], np.float64) and out["npfloat64"] == np.float64(0.1)
    assert type(out["py"][1]) is float


def test_int_keys_namedtuple_dataclass_with_target(ckdir):
    tree = {"ints": {1: np.ones(3), 2: np.zeros(2)}, "nt": Pair(np.int8(3), [1.0]),
            "dc": State({"w": jnp.ones((2, 2))}, 7), "key": jax.random.key(5),
            "keys": jax.random.split(jax.random.key(1), 4)}
    save(ckdir, tree)
    m = cc.CheckpointManager(ckdir, read_only=True)
    out = m.restore(target=tree)
    assert_tree_equal(out, tree)
    assert isinstance(out["nt"], Pair) and isinstance(out["dc"], State)
    plain = m.restore()
    assert set(plain["ints"]) == {1, 2} and plain["nt"]["first"] == 3 and plain["dc"]["step"] == 7
    # as docs/concepts.md §5 says: arrays as host numpy, Python numbers as themselves, typed keys
    # (numpy cannot hold them) as jax key arrays
    assert isinstance(plain["ints"][1], np.ndarray) and type(plain["dc"]["step"]) is int
    assert jax.dtypes.issubdtype(plain["keys"].dtype, jax.dtypes.prng_key)
    assert_tree_equal(jax.random.key_data(plain["keys"]), jax.random.key_data(tree["keys"]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_roundtrip_as_numpy_and_jax(ckdir, dtype):
    small = random_array((5, 3), dtype, 1)
    big = random_array((1024, 1100), dtype, 2) if np_dtype(dtype).itemsize <= 2 else random_array((600, 512), dtype, 2)
    sh = NamedSharding(mesh((4, 2)), P("a", None))
    tree = {"small": small, "big": big, "jsmall": jax.device_put(small), "jbig": jax.device_put(big, sh)}
    save(ckdir, tree)
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert_tree_equal(m.restore(), {k: np.asarray(v) for k, v in tree.items()})
    out = m.restore(target=tree)
    assert_tree_equal(out, tree)
    assert out["jbig"].sharding == sh


@pytest.fixture(params=["disk", "tmpfs"])
def storage_dir(request, tmp_path):
    """A directory on the test's temporary file system, or on /dev/shm (a memory file system:
    chunk files written through, never fsynced)."""
    if request.param == "disk":
        yield tmp_path
        return
    if localfs.fs_type("/dev/shm") not in localfs.MEMORY_FS or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    d = tempfile.mkdtemp(prefix="ckpt-test-", dir="/dev/shm")
    try:
        yield pathlib.Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.usefixtures("zarr_above_1mib")
@pytest.mark.parametrize("src", list(shardings()))
def test_reshard_cross_product(storage_dir, src, monkeypatch):
    """5+ save shardings x 6 restore shardings, including an uneven shape, on a disk and on a
    memory file system; the chunks a target cuts are read through a band (each chunk once)."""
    calls = {"banded": 0}

    def spy(*a, real=chunkread._read_banded, **k):
        calls["banded"] += 1
        return real(*a, **k)
    monkeypatch.setattr(chunkread, "_read_banded", spy)
    shapes = [(64, 48), (8, 8)]
    if src in ("replicated", "single"):
        shapes.append((13, 7))  # uneven: only where JAX allows it
    data = {f"x{i}": random_array(s, "float32", i) for i, s in enumerate(shapes)}
    data["big"] = random_array((512, 1024), "float32", 9)  # > pack limit: goes through zarr
    tree = {k: jax.device_put(v, shardings()[src]) for k, v in data.items()}
    d = str(storage_dir / src)
    save(d, tree)
    m = cc.CheckpointManager(d, read_only=True)
    for name, dst in shardings().items():
        # a leaf this sharding cannot hold is restored as host numpy (a numpy target leaf)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dst) if _allowed(dst, v.shape)
                  else np.broadcast_to(np.zeros((), v.dtype), v.shape) for k, v in data.items()}
        out = m.restore(target=target)
        for k, v in out.items():
            host = isinstance(target[k], np.ndarray)
            assert isinstance(v, np.ndarray) if host else (v.sharding == dst), (src, name, k)
            np.testing.assert_array_equal(np.asarray(v), data[k])
    assert m.restore()["big"].shape == (512, 1024)
    assert m.store.in_memory or not str(storage_dir).startswith("/dev/shm/")
    assert calls["banded"] > 0, calls


def _allowed(sharding, shape):
    try:
        sharding.shard_shape(shape)
        return True
    except ValueError:
        return False


def test_uneven_shape_on_mesh_where_jax_allows(ckdir):
    m2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sh = NamedSharding(m2, P("a", "b"))
    x = random_array((1023, 517), "float32", 3)
    try:
        a = jax.device_put(x, sh)
    except ValueError:
        pytest.skip("this JAX forbids uneven shardings")
    save(ckdir, {"a": a})
    out = cc.CheckpointManager(ckdir, read_only=True).restore(
        target={"a": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m2, P("b", "a")))})
    np.testing.assert_array_equal(np.asarray(out["a"]), x)


def test_restoring_one_device_slice_reads_one_eighth(ckdir):
    x = random_array((2048, 1024), "float32", 0)   # 8 MiB, 8 chunks of 1 MiB on the 8x1 mesh
    sh = NamedSharding(mesh((8, 1)), P("a", None))
    save(ckdir, {"x": jax.device_put(x, sh)})
    store = open_store(ckdir)
    reader = restore_mod.leaf_reader(store, 1, restore_mod.read_manifest(store, 1))
    rec = reader.m["leaves"][0]
    before = bytes_read()
    part = reader.read_box(rec, ((256, 512), (0, 1024)))
    got = bytes_read() - before
    np.testing.assert_array_equal(part, x[256:512])
    assert x.nbytes / 8 <= got <= x.nbytes / 8 * 1.01, got
    # and a whole restore onto a different mesh reads each byte about once
    before = bytes_read()
    cc.CheckpointManager(ckdir, read_only=True).restore(
        target={"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh((2, 4)), P("a", "b")))})
    assert bytes_read() - before <= x.nbytes * 1.1


def _chunk_files(d):
    out = []
    for dirpath, _, files in os.walk(d):
        out += [os.path.join(dirpath, f) for f in files if "/arrays/" in dirpath and f != "zarr.json"]
    return sorted(out)


@pytest.mark.usefixtures("zarr_above_1mib")
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_chunk_raises_corruption_naming_the_leaf(ckdir, damage):
    x = random_array((512, 1024), "float32", 0)
    save(ckdir, {"params": {"w": x}})
    f = _chunk_files(ckdir)[0]
    if damage == "flip":
        with open(f, "r+b") as fh:
            fh.seek(100)
            b = fh.read(1)
            fh.seek(100)
            fh.write(bytes([b[0] ^ 0x10]))
    elif damage == "truncate":
        os.truncate(f, os.path.getsize(f) // 2)
    else:
        os.remove(f)
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['params'\]\['w'\]") as e:
        cc.CheckpointManager(ckdir, read_only=True).restore()
    assert e.value.key_path == "['params']['w']"


@pytest.mark.usefixtures("zarr_above_1mib")
@pytest.mark.parametrize("read", ["whole", "reshard"])
def test_an_intact_chunk_of_another_save_is_refused_not_restored(storage_dir, read):
    """A chunk carries its own CRC, so a chunk file of another step (copied over this one's, a
    step directory merged from elsewhere) read as intact and restored silently wrong data, and
    `verify` passed it. The manifest records every chunk's CRC: whole-chunk reads, reads split
    between shards (through a band) and verify compare with it."""
    from ckpt_callbacks import verify
    sh = NamedSharding(mesh((4, 2)), P("a", "b"))
    x1, x2 = (jax.device_put(random_array((512, 1024), "float32", k), sh) for k in (1, 2))
    d = str(storage_dir / "run")
    with cc.CheckpointManager(d, async_save=False) as m:
        m.save(1, {"w": x1})
        m.save(2, {"w": x2})
    rec = [r for r in restore_mod.read_manifest(open_store(d), 2)["leaves"] if r["k"] == "array"][0]
    assert len(rec["cc"]) == 8 and len(set(rec["cc"])) == 8       # one recorded CRC per chunk
    step1, step2 = (os.path.join(d, f"step_000000000{k}", rec["z"], "c", "1", "1") for k in (1, 2))
    shutil.copyfile(step1, step2)
    dst = sh if read == "whole" else NamedSharding(mesh((2, 4)), P("a", "b"))
    m = cc.CheckpointManager(d, read_only=True)
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['w'\]: chunk .*c/1/1 is intact but is not the chunk") as e:
        m.restore(2, target={"w": jax.ShapeDtypeStruct(x2.shape, x2.dtype, sharding=dst)})
    assert e.value.key_path == "['w']"
    problems = verify.verify_step(open_store(d), 2)
    assert [p for p, _ in problems] == ["['w']"] and "is not the chunk this step saved" in problems[0][1]
    assert_tree_equal(m.restore(target={"w": x1}, fallback=True), {"w": x1})   # the intact step before it
    assert m.restored_step == 1


@pytest.mark.usefixtures("zarr_above_1mib")
def test_a_zarr_json_with_big_endian_bytes_is_damage_never_a_wrong_read(ckdir):
    """zarr.json has no checksum of its own: an edited endian made restore return byte-swapped
    values and `verify` say ok (no crc32c codec: test_reliability.py)."""
    codecs = [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]
    import json
    from ckpt_callbacks import verify
    save(ckdir, {"params": {"w": random_array((512, 1024), "float32", 0)}})
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_chunk_files(ckdir)[0]))), "zarr.json")
    meta = json.load(open(path))
    meta["codecs"] = codecs
    json.dump(meta, open(path, "w"))
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['params'\]\['w'\].*has codecs"):
        cc.CheckpointManager(ckdir, read_only=True).restore()
    assert verify.verify_step(open_store(ckdir), 1)


def test_damaged_packed_leaf_and_manifest(ckdir):
    save(ckdir, {"a": np.arange(100), "b": np.ones(3)})
    blob = [os.path.join(dp, f) for dp, _, fs in os.walk(ckdir) for f in fs if "blobs" in dp][0]
    data = bytearray(open(blob, "rb").read())
    data[-5] ^= 0xFF
    open(blob, "wb").write(bytes(data))
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['b'\]"):
        cc.CheckpointManager(ckdir, read_only=True).restore()
    man = os.path.join(ckdir, "step_0000000001", "manifest.msgpack")
    open(man, "wb").write(open(man, "rb").read()[:-7])
    with pytest.raises(cc.CorruptCheckpointError, match="manifest"):
        cc.CheckpointManager(ckdir, read_only=True).restore()


def test_a_step_directory_renamed_swapped_or_given_another_steps_manifest_is_damage(ckdir):
    # every byte intact, checksums and all, but of another step: restoring it would return that
    # step's data as this one's (and retention would rank it by that step's metrics)
    with cc.CheckpointManager(ckdir, async_save=False) as m:
        for s in (1, 2, 3):
            m.save(s, {"w": np.full(4, float(s))}, metrics={"loss": 1.0 / s})
    step = lambda s: os.path.join(ckdir, f"step_{s:010d}")
    os.rename(step(3), step(5))                                     # renamed to another step number
    os.rename(step(1), step(3)), os.rename(step(2), step(1)), os.rename(step(3), step(2))   # 1 and 2 swapped
    r = cc.CheckpointManager(ckdir, read_only=True)
    assert r.all_steps() == [1, 2, 5]                                 # still listed, as damaged
    for s, holds in ((5, 3), (1, 2), (2, 1)):
        with pytest.raises(cc.CorruptCheckpointError, match=f"manifest of step {holds}, not of step {s}"):
            r.restore(s)
        with pytest.raises(cc.CorruptCheckpointError):
            r.metrics(s)
    with pytest.raises(cc.CorruptCheckpointError):
        r.restore(fallback=True)                                      # no intact step left to fall back to
    os.rename(step(5), step(3))                                       # given back its own name: intact
    shutil.copy(os.path.join(step(3), "manifest.msgpack"), os.path.join(step(1), "manifest.msgpack"))
    assert r.restore(3)["w"].tolist() == [3.0] * 4
    with pytest.raises(cc.CorruptCheckpointError, match="manifest of step 3, not of step 1"):
        r.restore(1)


def test_mismatches_name_key_paths(ckdir):
    save(ckdir, {"a": np.zeros((2, 3), np.float32), "b": {"c": np.zeros(4, np.int32)}, "d": 1})
    m = cc.CheckpointManager(ckdir, read_only=True)
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(target={"a": np.zeros((3, 3), np.float32), "b": {"c": np.zeros(4, np.float32)}, "d": 1})
    msg = str(e.value)
    assert "['a']: checkpoint has float32[2, 3], target expects float32[3, 3]" in msg
    assert "['b']['c']: checkpoint has int32[4], target expects float32[4]" in msg
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(target={"a": np.zeros((2, 3), np.float32), "b": {"x": np.zeros(4, np.int32)}, "d": 1})
    assert "['b']['x']" in str(e.value) and "['b']['c']" in str(e.value)
    assert isinstance(e.value, ValueError) and len(e.value.mismatches) == 2


def test_a_target_no_checkpoint_can_hold_is_a_typed_error_naming_the_key_path(ckdir):
    """A target nested deeper than save allows, or with a key save refuses, raised a bare TypeError
    from restore (save raised InvalidTreeError for the same tree)."""
    save(ckdir, {"a": np.zeros(3, np.float32)})
    m = cc.CheckpointManager(ckdir, read_only=True)
    deep = np.zeros(3, np.float32)
    for _ in range(101):
        deep = {"a": deep}
    for target, says in [(deep, "at ['a']['a']"), ({("a", 1): np.zeros(3)}, "at <root>: dict key ('a', 1)"),
                         ({"a": {1: 0, "b": 0}}, "at ['a']: a dict with keys of types int, str")]:
        with pytest.raises(cc.InvalidTreeError) as e:
            m.restore(target=target)
        assert isinstance(e.value, cc.CheckpointError) and says in str(e.value)


def test_repeated_restores_and_verifies_of_array_leaves_keep_no_objects(ckdir):
    """tensorstore's Spec.to_json() never frees the containers nested in its result: each restore
    or verify of a zarr array leaf kept 11 objects (~4.7 KB) for good, so a process restoring
    checkpoints again and again (an evaluator following a run) grew without bound."""
    save(ckdir, {"big": np.arange(5 << 18, dtype=np.float32), "small": np.ones(3)})   # 5 MiB: a zarr leaf
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert objects_kept_by_restores(m, 1, rounds=20) < 100   # ~880 before


def test_python_scalar_target_leaves_match_only_their_kind_and_none_stands_for_anything(ckdir):
    saved = {"w": np.ones(3), "step": jnp.int32(7), "epoch": 2, "name": "run", "none": None, "c": np.complex64(1j)}
    save(ckdir, saved)
    m = cc.CheckpointManager(ckdir, read_only=True)
    ok = {"w": np.zeros(3), "step": 0, "epoch": 0.0, "name": "", "none": None, "c": None}   # a Python number
    out = m.restore(target=ok)                                                   # stands for a 0-d array
    assert out["step"] == 7 and out["epoch"] == 2 and out["name"] == "run" and out["none"] is None
    # None is a placeholder (a field that is None in a fresh train state): the saved value comes back
    out = m.restore(target=dict.fromkeys(saved))
    np.testing.assert_array_equal(out["w"], np.ones(3))
    assert out["step"] == 7 and out["epoch"] == 2 and out["name"] == "run" and out["none"] is None
    for key, leaf, has, expects in [("w", 0.0, "float64[3]", "float value"), ("step", "7", "int32[]", "str value"),
                                    ("epoch", "2", "int value", "str value"), ("none", 0, "None", "int value"),
                                    ("none", np.zeros(2), "None", "ndarray"), ("c", 0, "complex64[]", "int value"),
                                    ("name", b"run", "str value", "bytes value")]:
        with pytest.raises(cc.IncompatibleCheckpointError) as e:
            m.restore(target={**ok, key: leaf})
        assert f"['{key}']: checkpoint has {has}, target expects {expects}" in str(e.value), (key, leaf)
    # and the message says why the value does not fit
    save(ckdir, {"lr": 1e40, "n": 2 ** 31, "s": 1e-50, "f": 0.5, "b": True, "c": 2 ** 24 + 1}, step=3)
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(3, target={"lr": np.zeros((), np.float32), "n": np.zeros((), np.int32), "s": jnp.float32(0),
                             "f": np.zeros((), np.int8), "b": np.zeros((), np.int32), "c": np.zeros((), np.float32)})
    text = str(e.value)
    for why in ["['lr']: checkpoint has float value, target expects float32[] (the saved value 1e+40 would become inf",
                "['n']: checkpoint has int value, target expects int32[] (the saved value 2147483648 is outside "
                "int32's range [-2147483648, 2147483647])",
                "['s']: checkpoint has float value, target expects float32[] (the saved value 1e-50 would become 0 ",
                "['f']: checkpoint has float value, target expects int8[] (the saved value 0.5 is a float",
                "['b']: checkpoint has bool value, target expects int32[] (the saved value is True: a bool fills",
                "['c']: checkpoint has int value, target expects float32[] (the saved value 16777217 is not exactly "
                "representable in float32"]:
        assert why in text, (why, text)
    with pytest.raises(cc.IncompatibleCheckpointError, match=r"1e\+40 would become NaN \(it has no inf\) in float8_e4m3fn"):
        m.restore(3, target={"lr": np.zeros((), jnp.float8_e4m3fn), "n": None, "s": None, "f": None, "b": None, "c": None})


def test_a_saved_python_number_fills_a_0d_array_target_that_holds_it_exactly(ckdir):
    # a train state saved with Python counters, restored onto `jax.eval_shape`'s abstract state
    save(ckdir, {"step": 5, "lr": 0.5, "flag": True, "big": 2 ** 40, "neg": -3})
    m = cc.CheckpointManager(ckdir, read_only=True)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
              "lr": jax.ShapeDtypeStruct((), jnp.bfloat16, sharding=rep),
              "flag": np.bool_(False), "big": np.zeros((), np.int64), "neg": jnp.float32(0)}
    out = m.restore(target=target)
    assert out["step"].dtype == jnp.int32 and int(out["step"]) == 5 and out["step"].sharding == rep
    assert out["lr"].dtype == jnp.bfloat16 and float(out["lr"]) == 0.5
    assert isinstance(out["flag"], np.bool_) and out["flag"]
    assert isinstance(out["big"], np.ndarray) and out["big"].dtype == np.int64 and out["big"] == 2 ** 40
    assert out["neg"].dtype == jnp.float32 and float(out["neg"]) == -3.0
    # a float is rounded to the dtype's precision, as jnp.asarray would, but never to inf or 0
    save(ckdir, {"lr": 0.1, "tiny": 1e-9, "huge": 1e6}, step=2)
    out = m.restore(2, target={"lr": np.zeros((), jnp.bfloat16), "tiny": np.zeros((), np.float32),
                               "huge": np.zeros((), np.float32)})
    assert float(out["lr"]) == float(jnp.bfloat16(0.1)) and out["tiny"] == np.float32(1e-9) and out["huge"] == 1e6
    for key in ("tiny", "huge"):
        with pytest.raises(cc.IncompatibleCheckpointError, match=f"checkpoint has float value, target expects float16"):
            m.restore(2, target={"lr": 0.0, "tiny": 0.0, "huge": 0.0, key: np.zeros((), np.float16)})
    with pytest.raises(cc.IncompatibleCheckpointError, match="float8_e4m3fn"):   # which has NaN, not inf
        m.restore(2, target={"lr": 0.0, "tiny": 0.0, "huge": np.zeros((), jnp.float8_e4m3fn)})
    # ints are never rounded, wrapped or reinterpreted: the value must fit the target's dtype as it is
    for key, leaf, has, expects in [("big", np.zeros((), np.int32), "int value", "int32[]"),
                                    ("big", jnp.float16(0), "int value", "float16[]"),
                                    ("neg", np.zeros((), np.uint8), "int value", "uint8[]"),
                                    ("lr", np.zeros((), np.int32), "float value", "int32[]"),
                                    ("flag", np.zeros((), np.int32), "bool value", "int32[]"),
                                    ("step", np.zeros((1,), np.int32), "int value", "int32[1]")]:
        with pytest.raises(cc.IncompatibleCheckpointError) as e:
            m.restore(1, target={**target, key: leaf})
        assert f"['{key}']: checkpoint has {has}, target expects {expects}" in str(e.value), (key, leaf)


def test_a_0d_array_comes_back_an_array_and_a_numpy_scalar_a_scalar(ckdir):
    save(ckdir, {"count": np.array(5, np.int64), "j": jnp.float32(1.5), "s": np.float32(2.5)})
    m = cc.CheckpointManager(ckdir, read_only=True)
    for target in (None, {"count": np.zeros((), np.int64), "j": np.zeros((), np.float32), "s": np.float32(0)}):
        out = m.restore(target=target)
        assert type(out["count"]) is np.ndarray and out["count"].shape == () and out["count"] == 5
        out["count"][...] = 6   # writable, like the array that was saved
        assert type(out["j"]) is np.ndarray and out["j"].dtype == np.float32 and out["j"] == 1.5
        assert type(out["s"]) is np.float32 and out["s"] == 2.5
    out = m.restore(target={"count": 0, "j": 0.0, "s": 0.0})   # Python numbers: scalars, hashable
    assert {k: (type(v), v) for k, v in out.items()} == {
        "count": (np.int64, 5), "j": (np.float32, 1.5), "s": (np.float32, 2.5)}


@pytest.mark.usefixtures("zarr_above_1mib")
def test_a_step_deleted_and_written_over_while_it_is_read_is_never_returned(ckdir, monkeypatch):
    """A reader restores step 1 while a trainer with KeepLast(1) saves on: retention deletes step
    1 and the next save writes over its chunk files in place (checksums and all), under the
    reader's open file. The restore raises CheckpointNotFoundError instead of returning step 3."""
    import threading
    shape = (1024, 1024)   # 4 MiB: a zarr array leaf, read by chunkread
    trainer = cc.CheckpointManager(ckdir, retention=cc.KeepLast(1))
    trainer.save(1, {"w": np.full(shape, 1.0, np.float32)})
    trainer.wait_until_finished()
    opened, go, result = threading.Event(), threading.Event(), {}
    real_open = chunkread._open

    def held_open(path, nbytes, where):   # the reader is preempted right after opening a chunk
        fd = real_open(path, nbytes, where)
        opened.set()
        go.wait(60)
        return fd

    def read():
        try:
            result["value"] = cc.CheckpointManager(ckdir, read_only=True).restore(1)["w"]
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    monkeypatch.setattr(chunkread, "_open", held_open)
    reader = threading.Thread(target=read)
    reader.start()
    assert opened.wait(60)
    for step in (2, 3, 4):
        trainer.save(step, {"w": np.full(shape, float(step), np.float32)})
    trainer.wait_until_finished()
    go.set()
    reader.join(60)
    trainer.close()
    assert "value" not in result, f"restored {np.unique(result['value'])} for step 1"
    assert isinstance(result["error"], cc.CheckpointNotFoundError), result["error"]
    assert "step 1" in str(result["error"]) and "deleted or replaced while it was being restored" in str(result["error"])


def test_a_step_that_never_was_is_not_said_to_be_deleted(ckdir):
    save(ckdir, {"a": np.ones(3)})
    with pytest.raises(cc.CheckpointNotFoundError) as e:
        restore_mod.restore(open_store(ckdir), 99)
    assert not getattr(e.value, "deleted", False) and "deleted" not in str(e.value)


def test_a_latest_step_deleted_while_read_is_followed_by_the_new_latest(ckdir, monkeypatch, caplog):
    """A read-only evaluator restoring the latest step while a trainer saves on with KeepLast:
    the step it listed goes meanwhile; it lists again and reads the new latest."""
    save(ckdir, {"a": np.ones(3)}, step=1)
    save(ckdir, {"a": np.full(3, 2.0)}, step=2)
    real, calls = restore_mod.restore, []

    def racing(store, step, target=None, partial=False):
        calls.append(step)
        if step == 2:   # meanwhile the trainer commits step 3 and its retention deletes step 2
            if 3 not in store.committed_steps():
                save(ckdir, {"a": np.full(3, 3.0)}, step=3)
            raise restore_mod.deleted_error(store, step)
        return real(store, step, target, partial)

    monkeypatch.setattr(restore_mod, "restore", racing)
    m = cc.CheckpointManager(ckdir, read_only=True)
    with caplog.at_level("WARNING", logger="ckpt_callbacks"):
        out = m.restore()
    assert calls == [2, 3] and m.restored_step == 3 and out["a"][0] == 3.0
    assert "restoring the latest step again" in caplog.text
    with pytest.raises(cc.CheckpointNotFoundError, match="deleted or replaced"):   # an explicit step: raised
        m.restore(2)


def test_missing_checkpoint_and_unknown_version(ckdir, tmp_path):
    with pytest.raises(FileNotFoundError):
        cc.CheckpointManager(str(tmp_path / "nothing"), read_only=True).restore()
    with pytest.raises(cc.CheckpointNotFoundError):
        cc.CheckpointManager(str(tmp_path / "nothing"), read_only=True).restore(step=3)
    import msgpack
    save(ckdir, {"a": 1})
    man = os.path.join(ckdir, "step_0000000001", "manifest.msgpack")
    good = open(man, "rb").read()
    outer = msgpack.unpackb(good)
    outer["version"] = 0   # a flipped bit in the version, which lies outside the checksum: damage
    open(man, "wb").write(msgpack.packb(outer))
    with pytest.raises(cc.CorruptCheckpointError, match="format version 0 is not the one its checksummed body"):
        cc.CheckpointManager(ckdir, read_only=True).restore()
    # a newer format: its checksummed body says so too
    from ckpt_callbacks import format as fmt
    body = msgpack.unpackb(outer["body"])
    body["version"] = 99
    outer["body"] = msgpack.packb(body)
    outer["version"], outer["crc32c"] = 99, fmt.crc32c(outer["body"])
    open(man, "wb").write(msgpack.packb(outer))
    with pytest.raises(cc.IncompatibleCheckpointError, match="format version 99"):
        cc.CheckpointManager(ckdir, read_only=True).restore()


def test_a_damaged_format_version_is_damage_that_fallback_skips(ckdir):
    """The manifest's outer format version is not checksummed: a bit flipped there (1 -> 0) raised
    IncompatibleCheckpointError ("Upgrade ckpt_callbacks"), which fallback=True did not skip."""
    import msgpack
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, {"a": np.ones(3)})
        m.save(2, {"a": np.full(3, 2.0)})
    man = os.path.join(ckdir, "step_0000000002", "manifest.msgpack")
    outer = msgpack.unpackb(open(man, "rb").read())
    outer["version"] = 0
    open(man, "wb").write(msgpack.packb(outer))
    m = cc.CheckpointManager(ckdir, read_only=True)
    with pytest.raises(cc.CorruptCheckpointError):
        m.restore()
    got = m.restore(fallback=True)
    assert m.restored_step == 1 and np.array_equal(got["a"], np.ones(3))
    assert m.all_steps() == [1, 2]   # the damaged step stays listed


def test_unsupported_leaf_names_key_path(ckdir):
    with pytest.raises(cc.InvalidTreeError, match=r"\['opt'\]\[1\]"):
        save(ckdir, {"opt": [1, object()]})
    with pytest.raises(cc.InvalidTreeError, match="only str and int keys"):
        save(ckdir, {(1, 2): np.ones(2)})
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == []


def test_many_small_leaves_go_into_few_files(ckdir):
    tree = {f"l{i}": np.full((64,), i, np.float32) for i in range(2000)}
    save(ckdir, tree)
    files = [f for _, _, fs in os.walk(ckdir) for f in fs]
    assert len(files) <= 3, files   # manifest + 1 blob (+ lock)
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(), tree)


def test_replicated_small_leaves_are_adopted_from_the_blob_and_donating_them_is_safe(ckdir):
    rep = NamedSharding(mesh((4, 2)), P())
    host = {f"s{i:02d}": random_array((int(n),), dt, i)
            for i, (n, dt) in enumerate(zip([1, 3, 17, 256, 1000, 4096, 7, 64] * 3,
                                            ["float32", "bfloat16", "int8", "float32"] * 6))}
    save(ckdir, {k: jax.device_put(v, rep) for k, v in host.items()})
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in host.items()}
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        got = m.restore(1, target)
        again = m.restore(1, target)
    assert_tree_equal(jax.tree.map(np.asarray, got), host)
    # every blob entry starts 64-byte aligned, so the 8 replicas are the blob's bytes, not 8 copies
    for v in got.values():
        assert len({s.data.unsafe_buffer_pointer() for s in v.addressable_shards}) == 1
    # donating some restored leaves computes right and leaves their blob neighbours untouched
    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 2, t), donate_argnums=0)
    half = {k: got.pop(k) for k in list(got)[::2]}
    doubled = step(half)
    for k, v in doubled.items():
        np.testing.assert_array_equal(np.asarray(v), host[k] * 2)
    assert_tree_equal(jax.tree.map(np.asarray, got), {k: host[k] for k in got})
    assert_tree_equal(jax.tree.map(np.asarray, again), host)


def test_every_leaf_stored_as_a_zarr_array_roundtrips_including_0d(ckdir, monkeypatch):
    from ckpt_callbacks import snapshot
    monkeypatch.setitem(snapshot.plan.__kwdefaults__, "pack_max_bytes", -1)   # nothing packed
    sh = NamedSharding(mesh((4, 2)), P("a", "b"))
    tree = {"scalar": np.float32(3.5), "zero_d": jnp.asarray(7, jnp.int32), "empty": np.zeros((0, 3), np.float32),
            "x": jax.device_put(random_array((16, 8), "float32", 1), sh), "v": np.arange(5, dtype=np.int64)}
    save(ckdir, tree)
    store = open_store(ckdir)
    assert {r["k"] for r in restore_mod.read_manifest(store, 1)["leaves"]} == {"array"}
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(), jax.tree.map(np.asarray, tree))
    target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=getattr(v, "sharding", None))
                          if isinstance(v, jax.Array) else v, tree)
    got = cc.CheckpointManager(ckdir, read_only=True).restore(target=target)
    assert_tree_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, tree))


def test_a_prime_extent_is_chunked_with_a_padded_edge_chunk_and_restores_exactly(ckdir, monkeypatch):
    from ckpt_callbacks import snapshot
    monkeypatch.setitem(snapshot.plan.__kwdefaults__, "chunk_max_bytes", 64 << 10)
    monkeypatch.setitem(snapshot.plan.__kwdefaults__, "pack_max_bytes", -1)
    s = NamedSharding(mesh((4, 2)), P(None, "b"))   # dimension 0 sharded by no axis: whole
    tree = {"np": random_array((1031, 67), "float32", 1), "x": jax.device_put(random_array((1031, 130), "int32", 2), s)}
    save(ckdir, tree)
    leaves = {r["p"][0][1]: r for r in restore_mod.read_manifest(open_store(ckdir), 1)["leaves"]}
    assert leaves["np"]["ch"] == [207, 67] and leaves["x"]["ch"] == [207, 65]   # not [1, 67] / [1, 65]
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        assert_tree_equal(m.restore(), jax.tree.map(np.asarray, tree))
        got = m.restore(target={"np": np.zeros((1031, 67), np.float32), "x": jax.ShapeDtypeStruct((1031, 130), jnp.int32, sharding=s)})
    assert_tree_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, tree))
    from ckpt_callbacks import verify
    assert verify.verify_step(open_store(ckdir), 1) == []


def test_a_container_restored_into_another_class_with_the_same_fields_is_warned_about(ckdir, caplog):
    """adam's state restored into adabelief's: the same fields (count, mu, nu), so the key paths
    match; the values mean something else. Not refused (classes get renamed), but said."""
    import optax
    params = {"w": jnp.ones(3)}
    save(ckdir, {"opt": optax.adam(1e-3).init(params)})
    m = cc.CheckpointManager(ckdir, read_only=True)
    with caplog.at_level("WARNING", logger="ckpt_callbacks"):
        m.restore(target={"opt": optax.adam(1e-3).init(params)})
    assert "was saved as" not in caplog.text
    with caplog.at_level("WARNING", logger="ckpt_callbacks"):
        m.restore(target={"opt": optax.adabelief(1e-3).init(params)})
    assert ("['opt'][0] was saved as a ScaleByAdamState and is restored into the target's ScaleByBeliefState"
            in caplog.text), caplog.text


def test_a_target_leaf_jax_may_still_place_comes_back_so(ckdir):
    """optax's `count` (``jnp.zeros([], int32)``) and arrays never put on a device explicitly are
    uncommitted: jit moves them next to the sharded arrays they meet. Restored pinned to the default
    device, the first training step after a resume failed with "incompatible devices"."""
    s = NamedSharding(mesh((4, 2)), P("a", "b"))
    state = {"w": jax.device_put(jnp.ones((8, 4)), s), "count": jnp.zeros([], jnp.int32), "b": jnp.ones(3),
             "n": 5, "pinned": jax.device_put(jnp.ones(2), jax.devices()[3])}
    assert not state["count"].committed and not state["b"].committed
    save(ckdir, state)
    target = {**state, "n": jnp.zeros([], jnp.int32)}   # a saved Python number onto an uncommitted 0-d array
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        out = m.restore(1, target=target)
        abstract = m.restore(1, target=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, state))
    assert not out["count"].committed and not out["b"].committed and not out["n"].committed
    assert not abstract["count"].committed and not abstract["b"].committed
    assert out["w"].sharding == s and out["pinned"].committed and out["pinned"].devices() == {jax.devices()[3]}
    step = jax.jit(lambda t: (t["w"] * t["count"] + t["n"], t["b"] + t["count"]))
    np.testing.assert_array_equal(step(out)[0], np.full((8, 4), 5.0))   # raised before: incompatible devices
    assert int(out["n"]) == 5


def _no_reads(monkeypatch):
    """Fail the test if restore reads any leaf (its target checks come before every read)."""
    def read(*a, **k):
        raise AssertionError("a leaf was read before the target was refused")
    for name in ("prefetch", "read_box", "read_boxes"):
        monkeypatch.setattr(restore_mod.leaf_reader, name, read)


def test_prng_keys_onto_a_target_of_another_implementation_are_refused(ckdir, monkeypatch):
    """rbg and unsafe_rbg keys have the same key data (uint32[4]): the keys came back rbg, silently."""
    keys = jax.random.split(jax.random.key(0, impl="rbg"), 4)
    save(ckdir, {"k": keys, "one": jax.random.key(1, impl="rbg")})
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert jax.random.key_impl(m.restore(target={"k": keys, "one": None})["k"]) == jax.random.key_impl(keys)
    _no_reads(monkeypatch)
    other = {"k": jax.eval_shape(lambda: jax.random.split(jax.random.key(0, impl="unsafe_rbg"), 4)),
             "one": jax.random.key(1, impl="threefry2x32")}
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(target=other)
    msg = str(e.value)
    assert "['k']: checkpoint has key<rbg>[4], target expects key<unsafe_rbg>[4] (key data uint32[4, 4])" in msg
    assert "['one']: checkpoint has key<rbg>[], target expects key<threefry2x32>[] (key data uint32[2])" in msg


def test_a_64_bit_jax_target_without_x64_is_refused_before_reading(ckdir, monkeypatch):
    """With jax_enable_x64 off jax makes int64 int32 and float64 float32: an int64 leaf restored onto
    `ShapeDtypeStruct(int64)` came back int32 with wrong values, float64 as float32 (inf, 0)."""
    if jax.config.jax_enable_x64:
        pytest.skip("jax_enable_x64 is on")
    big = np.arange(2 ** 18, dtype=np.int64) * (2 ** 33 + 1)   # a zarr array
    saved = {"count": np.array([2 ** 40 + 7, -3], np.int64), "f": np.array([1e300, 1e-300]), "big": big,
             "n": 2 ** 40, "w": np.ones(3, np.float32)}
    save(ckdir, saved)
    m = cc.CheckpointManager(ckdir, read_only=True)
    sh = NamedSharding(mesh((2, 4)), P("a"))
    sds = {"count": jax.ShapeDtypeStruct((2,), np.int64), "f": jax.ShapeDtypeStruct((2,), np.float64),
           "big": jax.ShapeDtypeStruct(big.shape, np.int64, sharding=sh),
           "n": jax.ShapeDtypeStruct((), np.int64, sharding=NamedSharding(sh.mesh, P())),
           "w": jax.ShapeDtypeStruct((3,), np.float32)}
    # onto numpy targets, or None, 64-bit leaves come back as they were saved
    assert_tree_equal(m.restore(target={**saved, "n": 0}), saved)
    assert_tree_equal(m.restore(target=dict.fromkeys(saved)), saved)
    _no_reads(monkeypatch)
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(target=sds)
    msg = str(e.value)
    assert [w for w, _, _ in e.value.mismatches] == ["['big']", "['count']", "['f']", "['n']"], msg
    assert "['count']: checkpoint has int64[2], target expects int64[2] on jax, which makes it int32" in msg
    assert "['f']: checkpoint has float64[2], target expects float64[2] on jax, which makes it float32" in msg
    assert "['n']: checkpoint has int value, target expects int64[] on jax" in msg
    assert msg.count("jax_enable_x64 is off") == 4 and "numpy array target" in msg, msg


def test_64_bit_leaves_onto_jax_targets_under_enable_x64_come_back_exactly(ckdir):
    """`jax.enable_x64` holds for the calling thread only: the target check passed there, but the
    leaves put on devices on the restore's reading threads came back int32 (wrong values)."""
    enable_x64 = getattr(jax, "enable_x64", None)
    if enable_x64 is None:
        pytest.skip("this JAX has no jax.enable_x64")
    saved = {"count": np.array([2 ** 40 + 7, -3], np.int64), "f": np.array([1e300, 1e-300]), "n": 2 ** 40,
             "p": 2 ** 40, "big": np.arange(2 ** 18, dtype=np.int64) * (2 ** 33 + 1)}
    save(ckdir, saved)
    rep = NamedSharding(mesh((2, 4)), P())
    target = {"count": jax.ShapeDtypeStruct((2,), np.int64), "f": jax.ShapeDtypeStruct((2,), np.float64),
              "n": jax.ShapeDtypeStruct((), np.int64), "p": jax.ShapeDtypeStruct((), np.int64, sharding=rep),
              "big": jax.ShapeDtypeStruct((2 ** 18,), np.int64, sharding=NamedSharding(rep.mesh, P("a")))}
    with enable_x64(True):
        out = cc.CheckpointManager(ckdir, read_only=True).restore(target=target)
    for k, v in out.items():
        assert v.dtype == target[k].dtype, (k, v.dtype)
        np.testing.assert_array_equal(np.asarray(v), saved[k])
    assert not out["n"].committed and out["p"].sharding == rep



def test_placement_free_leaves_follow_the_callers_default_device(ckdir):
    """`jax.default_device` holds for the calling thread only: leaves that leave their placement
    to jax (uncommitted arrays, ShapeDtypeStructs without a sharding, typed keys) were put on
    device 0 by the restore's reading threads, and on the caller's device when there was one leaf."""
    saved = {"count": np.int32(3), "w": np.arange(6.0, dtype=np.float32), "key": jax.random.key(1),
             "mu": np.ones((2, 3), np.float32)}
    save(ckdir, saved)
    target = {"count": jnp.zeros((), jnp.int32), "w": jax.ShapeDtypeStruct((6,), np.float32),
              "key": jax.random.key(0), "mu": jnp.zeros((2, 3))}
    dev = jax.devices()[5]
    with jax.default_device(dev):
        out = cc.CheckpointManager(ckdir, read_only=True).restore(target=target)
    for k, v in out.items():
        assert v.devices() == {dev} and not v.committed, (k, v.devices())
    assert_tree_equal({k: v for k, v in out.items() if k != "key"}, {k: v for k, v in saved.items() if k != "key"})
    np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(saved["key"]))


def test_weakly_typed_target_leaves_come_back_weakly_typed(ckdir):
    """A weakly typed leaf (`jnp.asarray(0.9)`, TrainState's `step` after a jitted step) came back
    strong: weak float32 * bfloat16 is bfloat16 but float32 * bfloat16 float32, so a resumed run
    trained (and saved) in another dtype, and the next resume refused its own checkpoint."""
    rep = NamedSharding(mesh((4, 2)), P())
    weak = {"decay": jnp.asarray(0.9), "step": jnp.asarray(7), "vec": jnp.broadcast_to(0.5, (8,)),
            "pinned": jax.device_put(jnp.asarray(2.5), rep)}
    strong = {"decay_s": jnp.float32(0.9), "vec_s": jnp.full((8,), 0.5, jnp.float32)}
    assert all(v.weak_type for v in weak.values()) and not any(v.weak_type for v in strong.values())
    save(ckdir, {**weak, **strong})
    m = cc.CheckpointManager(ckdir, read_only=True)
    abstract = {"decay": jax.ShapeDtypeStruct((), np.float32, weak_type=True),
                "vec": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(rep.mesh, P("a")), weak_type=True)}
    for target in ({**weak, **strong}, {**weak, **strong, **abstract}):
        out = m.restore(target=target)
        for k, v in out.items():
            assert v.weak_type == target[k].weak_type, k
            t = target[k]
            assert v.dtype == t.dtype and v.committed == (t.committed if isinstance(t, jax.Array) else t.sharding is not None), k
        assert_tree_equal(out, {**weak, **strong})
        assert (out["decay"] * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
        assert out["vec"].sharding == getattr(target["vec"], "sharding", out["vec"].sharding)


def test_a_target_sharding_that_does_not_divide_the_shape_is_refused_before_reading(ckdir, monkeypatch):
    """jax (0.10) cannot place (10,) split 4 ways: it raised its own IndivisibleError while the leaves were
    read, naming no key path. Checked as jax does (`Sharding.shard_shape`), so what jax places passes."""
    saved = {"small": np.arange(10.0, dtype=np.float32), "big": np.zeros((1030, 512), np.float32),
             "keys": jax.random.split(jax.random.key(0), 10), "ok": np.arange(12.0, dtype=np.float32)}
    save(ckdir, saved)
    m = cc.CheckpointManager(ckdir, read_only=True)
    sh = NamedSharding(mesh((4, 2)), P("a"))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in saved.items()}
    assert m.restore(target={**dict.fromkeys(saved), "ok": target["ok"]})["ok"].sharding == sh
    _no_reads(monkeypatch)
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(target=target)
    msg = str(e.value)
    assert [w for w, _, _ in e.value.mismatches] == ["['big']", "['keys']", "['small']"], msg
    for key, has in [("small", "float32[10]"), ("big", "float32[1030, 512]"), ("keys", "key<threefry2x32>[10]")]:
        assert f"['{key}']: checkpoint has {has}, target expects {has} sharded by {sh}, which does not divide" in msg

def test_structure_mismatches_are_said_as_what_they_are(ckdir):
    """A dict with int keys where a list was saved printed each path twice ("checkpoint has it:
    no" and "yes": both render as [0]); None where a tuple was saved said the checkpoint lacked
    a path it has (a container there, not a leaf). Plain leftovers keep the old lines."""
    save(ckdir, {"opt": [np.ones(2), np.zeros(2)], "t": (1, 2.0), "w": np.ones(3), "s": np.ones(1)})
    m = cc.CheckpointManager(ckdir, read_only=True)
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(1, target={"opt": {0: np.ones(2), 1: np.zeros(2)}, "t": None, "w": {"a": np.ones(3)},
                             "x": np.ones(1)})
    text = str(e.value)
    assert "['opt'][0]: both have it, under other kinds of key at ['opt']: the checkpoint a list/tuple index, " \
           "the target a dict key" in text
    assert "['t']: the checkpoint holds a container of 2 leaves there, the target a single leaf" in text
    assert "['w']: the checkpoint holds a single leaf there, the target a container of 1 leaves" in text
    assert "['x']: checkpoint has it: no, target has it: yes" in text
    assert "['s']: checkpoint has it: yes, target has it: no" in text
    assert "checkpoint has it: no" not in text.split("['x']")[0]   # no other path said missing
    assert len(e.value.mismatches) == 11   # the structured list: every leaf path on either side, as before
    assert "differs from the checkpoint's in 6 place(s) (11 key paths):" in text   # as many places as lines
    with pytest.raises(cc.IncompatibleCheckpointError, match=r"in 1 place\(s\) \(7 key paths\):\n  <root>: "):
        m.restore(target=np.zeros(2))


def test_a_jax_target_of_a_dtype_jax_cannot_hold_is_refused_before_reading(ckdir, monkeypatch):
    """A ShapeDtypeStruct takes any ml_dtypes type, but no jax array is float8_e5m3fnu and no CPU
    array float6 (up to jax 0.10; from 0.11 on a CPU array can be float6): such a target raised
    jax's TypeError / JaxRuntimeError after reading, naming no key path, instead of an
    IncompatibleCheckpointError."""
    saved = {"f6": np.zeros(3, ml_dtypes.float6_e2m3fn), "f8": np.zeros(3, ml_dtypes.float8_e5m3fnu),
             "ok": np.zeros(3, ml_dtypes.float8_e4m3fn)}
    save(ckdir, saved)
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert_tree_equal(m.restore(target=saved), saved)   # onto numpy targets they come back as saved

    def jax_holds(x):
        try:
            jax.block_until_ready(jax.device_put(x))
            return True
        except Exception:  # noqa: BLE001 - jax's TypeError or JaxRuntimeError
            return False
    refused = [f"['{k}']" for k in ("f6", "f8") if not jax_holds(saved[k])]
    assert "['f8']" in refused
    _no_reads(monkeypatch)
    with pytest.raises(cc.IncompatibleCheckpointError) as e:
        m.restore(target={k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in saved.items()})
    assert [w for w, _, _ in e.value.mismatches] == refused, str(e.value)
    if "['f6']" in refused:
        assert "float6_e2m3fn[3] on jax, which cannot hold that dtype on cpu" in str(e.value)
    else:   # a float6 target that jax can make is restored like any other
        monkeypatch.undo()
        got = m.restore(target={"f6": jax.ShapeDtypeStruct((3,), saved["f6"].dtype)}, partial=True)
        assert_tree_equal(jax.device_get(got), {"f6": saved["f6"]})


def test_a_big_endian_numpy_target_gets_its_byte_order_back(ckdir):
    """A `>f4` numpy leaf is saved as float32 (little-endian bytes); restored onto itself as the
    target it came back `<f4`: the target's dtype, which matched by name, was not kept."""
    saved = {"be": np.arange(6, dtype=">f4").reshape(2, 3), "be0": np.array(-3, ">i8"),
             "le": np.arange(3, dtype="<u2")}
    save(ckdir, saved)
    m = cc.CheckpointManager(ckdir, read_only=True)
    out = m.restore(target=saved)
    for k, v in saved.items():
        assert type(out[k]) is np.ndarray and out[k].dtype == v.dtype, (k, out[k].dtype)
        np.testing.assert_array_equal(out[k], v)
    assert m.restore()["be"].dtype == np.dtype("=f4")   # without a target: native, as recorded


def test_partial_restore_reads_the_targets_part_and_still_checks_it(ckdir):
    """A training state's parameters without its optimizer state: ``partial=True`` restores the
    leaves the target has (onto its shardings) and leaves the checkpoint's others out; a leaf the
    target has and the step lacks, or one that does not fit, still raises naming its key path."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x", "y")))
    state = {"params": {"w": w, "b": jnp.ones(3)}, "opt": {"mu": jnp.zeros((8, 8)), "count": jnp.int32(7)}}
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, state)
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        one = SingleDeviceSharding(jax.devices()[3])
        target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=one), "b": np.zeros(3, np.float32)}}
        out = m.restore(target=target, partial=True)
        assert set(out) == {"params"} and set(out["params"]) == {"w", "b"}
        assert out["params"]["w"].sharding == one and m.restored_step == 1
        np.testing.assert_array_equal(out["params"]["w"], np.arange(64.0).reshape(8, 8))
        np.testing.assert_array_equal(out["params"]["b"], np.ones(3))
        with pytest.raises(cc.IncompatibleCheckpointError, match="differs"):   # without partial: strict
            m.restore(target=target)
        with pytest.raises(cc.IncompatibleCheckpointError, match=r"\['params'\]\['v'\]") as e:
            m.restore(target={"params": {"v": np.zeros(3, np.float32)}}, partial=True)
        assert e.value.mismatches == [("['params']['v']", "absent", "present")]
        with pytest.raises(cc.IncompatibleCheckpointError, match=r"\['opt'\]\['count'\].*int32"):
            m.restore(target={"opt": {"count": np.zeros((), np.float32)}}, partial=True)
        with pytest.raises(cc.ConfigError, match="needs a target"):
            m.restore(partial=True)
        with pytest.raises(cc.ConfigError, match="partial"):
            m.restore(target=target, partial="yes")


@pytest.mark.parametrize("memory_kind", ["pinned_host", "unpinned_host"])
def test_an_array_leaf_restores_onto_a_target_in_host_memory(ckdir, monkeypatch, memory_kind):
    """An optimizer state offloaded to host memory (``memory_kind="pinned_host"``) comes back
    there; its shards of a zarr-stored leaf used to go to the devices' default memory, and jax
    refused to assemble them ("Memory kind mismatch"), naming no leaf."""
    from ckpt_callbacks import snapshot
    monkeypatch.setitem(snapshot.plan.__kwdefaults__, "pack_max_bytes", -1)   # every leaf a zarr array
    s = NamedSharding(mesh((4, 2)), P("a"), memory_kind=memory_kind)
    one = SingleDeviceSharding(jax.devices()[2], memory_kind=memory_kind)
    host = random_array((8, 4), "float32", 1)
    tree = {"mu": jax.device_put(host, s), "nu": jax.device_put(host, one)}
    save(ckdir, tree)
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        for target in (tree, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)):
            got = m.restore(target=target)
            for k in tree:
                assert got[k].sharding == tree[k].sharding
                assert {sh.data.sharding.memory_kind for sh in got[k].addressable_shards} == {memory_kind}
                np.testing.assert_array_equal(np.asarray(got[k]), host)


def test_an_abstract_state_from_eval_shape_under_set_mesh_restores_onto_that_mesh(ckdir):
    """Explicit sharding: `jax.eval_shape` under ``jax.set_mesh(mesh)`` gives ShapeDtypeStructs
    sharded over ``mesh.abstract_mesh``, which names no devices; jax raised "_device_assignment is
    not implemented", naming no leaf. Inside `set_mesh` of that mesh they restore onto it; outside
    it (or under another mesh) the restore refuses them before reading, naming their key paths."""
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    m = jax.make_mesh((4, 2), ("a", "b"), axis_types=explicit)

    def init():
        return {"w": jnp.zeros((8, 8), out_sharding=P("a", "b")), "keys": jax.random.split(jax.random.key(0), 8)}
    with jax.set_mesh(m):
        state = jax.jit(init)()
        state["w"] = state["w"] + jnp.arange(64.0).reshape(8, 8)
        abstract = jax.eval_shape(init)
    assert isinstance(abstract["w"].sharding.mesh, jax.sharding.AbstractMesh)
    save(ckdir, state)
    with cc.CheckpointManager(ckdir, read_only=True) as r:
        with jax.set_mesh(m):
            got = r.restore(target=abstract)
        assert_tree_equal(got, state)
        assert all(got[k].sharding == state[k].sharding for k in state)
        for mesh_ctx in (None, jax.make_mesh((2, 4), ("a", "b"), axis_types=explicit)):
            with pytest.raises(cc.IncompatibleCheckpointError, match=r"\['w'\]: .*an abstract mesh") as e:
                if mesh_ctx is None:
                    r.restore(target=abstract)
                else:
                    with jax.set_mesh(mesh_ctx):
                        r.restore(target=abstract)
            assert [w for w, _, _ in e.value.mismatches] == ["['keys']", "['w']"]


def test_a_saved_python_float_never_saturates_or_loses_its_nan_in_a_0d_target_without_inf_or_nan(ckdir):
    """float4_e2m1fn and float6_* have neither inf nor NaN: a saved 1e10 came back as their largest
    value (6.0, 7.5) and a saved NaN as -0.0, silently; both are refused now, naming the key path.
    Values within the range are still rounded to the dtype's precision."""
    save(ckdir, {"scale": 1e10, "loss": float("nan"), "lr": 0.5})
    save(ckdir, {"inf": float("inf")}, step=2)
    m = cc.CheckpointManager(ckdir, read_only=True)
    for name, top in (("float4_e2m1fn", 6.0), ("float6_e2m3fn", 7.5), ("float6_e3m2fn", 28.0)):
        dt = np.dtype(getattr(ml_dtypes, name))
        with pytest.raises(cc.IncompatibleCheckpointError) as e:
            m.restore(1, target={"scale": np.zeros((), dt), "loss": np.zeros((), dt), "lr": np.zeros((), dt)})
        assert [w for w, _, _ in e.value.mismatches] == ["['loss']", "['scale']"], name
        assert f"outside {name}'s range [{-top}, {top}]" in str(e.value) and "which has no NaN" in str(e.value)
        assert m.restore(1, target={"scale": 0.0, "loss": 0.0, "lr": np.zeros((), dt)})["lr"] == 0.5
        with pytest.raises(cc.IncompatibleCheckpointError, match=f"the saved value inf would become {top} in {name}"):
            m.restore(2, target={"inf": np.zeros((), dt)})   # (the message said "0")
    out = m.restore(1, target={"scale": np.zeros((), np.float32), "loss": np.zeros((), ml_dtypes.float8_e4m3fn), "lr": 0.0})
    assert out["scale"] == np.float32(1e10) and np.isnan(out["loss"].astype(np.float32))   # (NaN where it has one)
