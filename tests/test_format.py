"""Format v1 stability (golden checkpoint), manifest validation, and the no-orbax import rule."""

import os
import subprocess
import sys

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt_callbacks as cc
from ckpt_callbacks import format as fmt
from helpers import assert_tree_equal

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden_v1")


def golden_tree():
    rng = np.random.default_rng(1234)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    big = rng.standard_normal((512, 640)).astype(np.float32)   # > 1 MiB: a zarr array
    return {
        "params": {"w": jax.device_put(big, NamedSharding(mesh, P("a", "b"))),
                   "b": jax.device_put(rng.standard_normal(16).astype(ml_dtypes.bfloat16))},
        "opt": [np.arange(10, dtype=np.int64), (np.float32(0.5), None)],
        "ids": {3: np.array([1, -2], np.int8).astype(ml_dtypes.int4)},
        "rng": jax.random.key(42),
        "meta": {"name": "golden", "epoch": 3, "flag": True, "raw": b"\x00\x01"},
        "empty": {},
    }


def test_golden_v1_restores_bit_exactly():
    m = cc.CheckpointManager(GOLDEN, read_only=True)
    assert m.all_steps() == [7] and m.metrics(7) == {"val_loss": 0.25}
    expected = golden_tree()
    assert_tree_equal(m.restore(target=expected), expected)
    plain = m.restore()
    np.testing.assert_array_equal(plain["params"]["w"], np.asarray(expected["params"]["w"]))
    assert plain["meta"] == expected["meta"] and plain["empty"] == {}


def test_manifest_checksum_and_magic():
    body = fmt.pack_manifest({"version": 1, "step": 1, "leaves": [], "tree": {"t": "dict", "n": "", "c": []}})
    assert fmt.unpack_manifest(body)["step"] == 1
    with pytest.raises(cc.CorruptCheckpointError):
        fmt.unpack_manifest(body[:-3])
    with pytest.raises(cc.CorruptCheckpointError, match="not a ckpt_callbacks manifest"):
        fmt.unpack_manifest(msgpack.packb({"hello": 1}))
    with pytest.raises(cc.CorruptCheckpointError):
        fmt.unpack_manifest(b"\xff" * 100)


@pytest.mark.parametrize("bad", [
    {"z": "../../etc"}, {"z": "/abs/path"}, {"dt": "object"}, {"sh": [2**41, 2**41]}, {"sh": [-1]},
    {"k": "pickle"}, {"p": [["x", "a"]]}, {"cc": [1, 2]}, {"cc": [-1]}, {"cc": [1 << 32]}, {"cc": "x"},
    {"k": "py", "v": {"__class__": "os.system"}}, {"k": "py", "v": [1, 2]}, {"k": "py"},   # inline: scalars only
])
def test_hostile_manifest_fields_are_rejected(bad):
    leaf = {"p": [["d", "a"]], "k": "array", "dt": "float32", "sh": [4], "z": "arrays/0", "ch": [4]}
    leaf.update(bad)
    m = {"version": 1, "step": 1, "leaves": [leaf], "tree": {"t": "dict", "n": "", "c": [[["d", "a"], {"l": 0}]]}}
    with pytest.raises((cc.CorruptCheckpointError, cc.IncompatibleCheckpointError)):
        fmt.unpack_manifest(fmt.pack_manifest(m))


def test_inline_python_scalars_pass_validation():
    leaves = [{"p": [["d", str(i)]], "k": "py", "v": v} for i, v in enumerate([1, 2.5, True, "s", b"b", -2**63])]
    m = {"version": 1, "step": 1, "leaves": leaves,
         "tree": {"t": "dict", "n": "", "c": [[["d", str(i)], {"l": i}] for i in range(len(leaves))]}}
    assert [leaf["v"] for leaf in fmt.unpack_manifest(fmt.pack_manifest(m))["leaves"]] == [1, 2.5, True, "s", b"b", -2**63]


def test_step_names_sort():
    names = [fmt.step_name(s) for s in (0, 9, 10, 123456789)]
    assert names == sorted(names) and fmt.parse_step_name(names[-1]) == 123456789
    assert fmt.parse_step_name("step_12") is None and fmt.parse_step_name("step_0000000001.tmp-abcdef01") is None


def test_package_imports_without_orbax_or_pickle():
    code = (
        "import sys, importlib, pkgutil\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'orbax':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "for m in [k for k in sys.modules if k.split('.')[0] in ('orbax',)]: del sys.modules[m]\n"
        "import ckpt_callbacks\n"
        "for mod in pkgutil.iter_modules(ckpt_callbacks.__path__):\n"
        "    if mod.name.startswith('bench'): continue\n"
        "    importlib.import_module('ckpt_callbacks.' + mod.name)\n"
        "assert not [k for k in sys.modules if k.startswith('orbax')]\n"
        "print('ok')\n")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    src = os.path.dirname(cc.__file__)
    for name in os.listdir(src):
        if name.endswith(".py"):
            lines = open(os.path.join(src, name)).read().splitlines()
            imports = [l.strip() for l in lines if l.strip().startswith(("import ", "from "))]
            assert not [l for l in imports if "pickle" in l], name             # nowhere, benchmarks included
            if not name.startswith("bench"):                                  # Orbax: only as a benchmark peer
                assert not [l for l in imports if l.split()[1].startswith("orbax")], name


def test_pack_bins_is_byte_identical_to_msgpack():
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.binary(max_size=300), max_size=40), st.sampled_from([0, 255, 256, 65535, 65536]))
    def check(items, big):
        items = items + [b"z" * big]
        parts, index = fmt.pack_bins(items)
        blob = b"".join(bytes(p) for p in parts)
        assert blob == msgpack.packb(items, use_bin_type=True) and index == list(range(len(items)))
        assert [blob[o:o + n] for o, n in fmt.bin_entries(blob)] == items

    check()


def test_aligned_blobs_start_every_item_on_the_boundary_and_stay_plain_msgpack():
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.binary(max_size=300), max_size=40), st.sampled_from([0, 1, 255, 256, 65535, 65536]))
    def check(items, big):
        items = items + [b"z" * big]
        parts, index = fmt.pack_bins(items, align=fmt.BLOB_ALIGN)
        blob = b"".join(bytes(p) for p in parts)
        decoded = msgpack.unpackb(blob)
        assert [decoded[i] for i in index] == items
        entries = fmt.bin_entries(blob)
        for i, item in zip(index, items):
            off, n = entries[i]
            assert off % fmt.BLOB_ALIGN == 0 and blob[off:off + n] == item

    check()


def test_items_of_a_blob_start_on_each_ones_own_boundary_up_to_a_page_and_beyond_bin8_padding():
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.binary(max_size=300), st.sampled_from([1, 64, 512, 4096, 65536])), max_size=30))
    def check(pairs):
        items, aligns = [p[0] for p in pairs] + [b"z" * 70_000], [p[1] for p in pairs] + [4096]
        parts, index = fmt.pack_bins(items, align=aligns)
        blob = b"".join(bytes(p) for p in parts)
        decoded = msgpack.unpackb(blob)
        assert [decoded[i] for i in index] == items
        entries = fmt.bin_entries(blob)
        for i, item, a in zip(index, items, aligns):
            off, n = entries[i]
            assert off % a == 0 and blob[off:off + n] == item

    check()
    assert [fmt.blob_align(n) for n in (0, 100, (64 << 10) - 1, 64 << 10, 4 << 20)] == [64, 64, 64, 4096, 4096]


@pytest.mark.parametrize("blob", [b"", b"\x91", b"\x91\xc4\x05abc", b"\x91\xa3abc", b"\x80",
                                  b"\x91\xc4\x01ab", b"\xdc\x00", b"\x92\xc4\x00"])
def test_bin_entries_refuses_anything_but_an_exact_array_of_bins(blob):
    with pytest.raises(ValueError):
        fmt.bin_entries(blob)


def test_host_state_takes_numpy_numbers_and_names_the_path_of_what_it_cannot_store():
    state = {"pos": np.int64(7), "frac": np.float32(0.5), "seen": [np.bool_(True), (1, 2)], 3: None}
    back = msgpack.unpackb(fmt.pack_host_state(state), raw=False, strict_map_key=False)
    assert back == {"pos": 7, "frac": 0.5, "seen": [True, [1, 2]], 3: None}
    assert type(back["pos"]) is int
    for bad, where, what in [({"it": {"pos": [1, 2**70]}}, "['it']['pos'][1]", "64 bits"),
                             ({"it": {"buf": np.zeros(3)}}, "['it']['buf']", "numpy.ndarray"),
                             ({"it": {"s": {1, 2}}}, "['it']['s']", "builtins.set"),
                             ({"it": [{(1, 2): 3}]}, "['it'][0] (key (1, 2))", "dict keys"),
                             (_cycle(), "['self']['self']", "a cycle?"),
                             ({"it": msgpack.ExtType(1, b"x")}, "", "ExtType")]:
        with pytest.raises(TypeError) as e:
            fmt.pack_host_state(bad)
        assert (not where or f"at host_state{where}" in str(e.value)) and what in str(e.value), str(e.value)


def _cycle():
    c = {"pos": 1}
    c["self"] = c
    return c



def _ml_dtypes_types():
    """Every numpy scalar type ml_dtypes defines (names as numpy spells its dtype)."""
    names = []
    for name in dir(ml_dtypes):
        t = getattr(ml_dtypes, name)
        if isinstance(t, type) and issubclass(t, np.generic):
            names.append(np.dtype(t).name)
    return sorted(set(names))


@pytest.mark.parametrize("packed", [True, False])
def test_every_ml_dtypes_type_is_saved_bit_cast_and_restored_bit_exactly(tmp_path, monkeypatch, packed):
    from ckpt_callbacks import snapshot
    if not packed:
        monkeypatch.setattr(snapshot, "PACK_MAX_BYTES", 0)
    names = _ml_dtypes_types()
    assert {"float8_e4m3fn", "int4", "float8_e5m3fnu"} <= set(names)   # (ml_dtypes 0.5+: float8_e5m3fnu)
    rng = np.random.default_rng(0)
    tree = {}
    for name in names:
        dt = np.dtype(getattr(ml_dtypes, name))
        if name.startswith(("int", "uint")):   # sub-byte ints: valid values only
            info = ml_dtypes.iinfo(dt)
            raw = rng.integers(int(info.min), int(info.max) + 1, 6).astype(dt).view(np.uint8)
        elif "complex" in name:   # two halves, any bits
            raw = rng.integers(0, 256, 6 * dt.itemsize).astype(np.uint8)
        else:   # every bit pattern of the type's width (NaN payloads included)
            raw = rng.integers(0, 1 << ml_dtypes.finfo(dt).bits, 6).astype(f"<u{dt.itemsize}").view(np.uint8)
        tree[name] = raw.view(dt).reshape(2, 3)
    with cc.CheckpointManager(tmp_path) as m:
        m.save(1, tree)
        m.wait_until_finished()
        out = m.restore(1)
        kinds = {r["k"] for r in fmt.unpack_manifest(m.store.read(f"{fmt.step_name(1)}/manifest.msgpack"))["leaves"]}
    assert kinds == ({"packed"} if packed else {"array"})
    for name in names:
        assert out[name].dtype == tree[name].dtype and out[name].tobytes() == tree[name].tobytes(), name
