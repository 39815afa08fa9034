"""Shared test helpers: trees of every supported kind, and exact comparison."""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import os

import jax
import ml_dtypes
import numpy as np
import pytest

Pair = collections.namedtuple("Pair", ["first", "second"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    params: dict
    step: int = dataclasses.field(metadata={"static": False}, default=0)


DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "float8_e4m3b11fnuz", "int4", "int8", "int16", "int32", "int64",
          "uint4", "uint8", "uint16", "uint32", "uint64", "bool", "complex64"]


def np_dtype(name):
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def random_array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dt = np_dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dtype in ("int4", "uint4"):
        lo = -8 if dtype == "int4" else 0
        return rng.integers(lo, lo + 16, shape).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dt)
    return rng.standard_normal(shape).astype(np.float32).astype(dt)


def assert_tree_equal(a, b):
    """Bit-exact equality of two trees, including structure, leaf types and dtypes."""
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert ta == tb, f"structures differ:\n{ta}\n{tb}"
    for x, y in zip(la, lb):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
            y = jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            xa, ya = np.asarray(x), np.asarray(y)
            assert xa.dtype == ya.dtype and xa.shape == ya.shape, (xa.dtype, ya.dtype, xa.shape, ya.shape)
            assert xa.tobytes() == ya.tobytes()
        else:
            assert type(x) is type(y) and x == y, (x, y)


def bytes_read():
    """Bytes this process has read so far through read(2)-family calls (``rchar``: tensorstore's
    reads and the restore's own chunk reads alike) and from mappings of chunk files (tmpfs);
    the bench's own counter."""
    from ckpt_callbacks.bench_peers import bytes_read as counted
    return counted()


def skip_without_direct_io(directory) -> None:
    """Skip the test where the file system under `directory` (created if missing) refuses to
    switch a file to O_DIRECT."""
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, "probe")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as e:
        pytest.skip(f"no O_DIRECT on this file system: {e}")
    finally:
        os.close(fd)
        os.unlink(probe)


def objects_kept_by_restores(mngr, step: int, rounds: int) -> int:
    """How many Python objects `rounds` restores and verifies of `step` leave behind (after three
    warm-up rounds): a leak per read (tensorstore's Spec.to_json) grows it with every round."""
    import gc

    from ckpt_callbacks import verify
    for _ in range(3):
        mngr.restore(step), verify.verify_step(mngr.store, step)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(rounds):
        out = mngr.restore(step)
        assert verify.verify_step(mngr.store, step) == []
    del out
    gc.collect()
    return len(gc.get_objects()) - before
