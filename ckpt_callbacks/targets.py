"""Whether a restore target's leaf can take a saved leaf, and if not, why: the checks that turn
into the lines of an `IncompatibleCheckpointError`, made before anything is read.

Example::

    import numpy as np
    from ckpt_callbacks import targets
    rec = {"k": "array", "dt": "float32", "sh": [4, 4]}        # a manifest's leaf record
    assert targets.check(rec, np.zeros((4, 4), np.float32), "['w']") is None
    print(targets.check(rec, np.zeros((4,), np.float32), "['w']"))   # ("['w']", 'float32[4, 4]', 'float32[4]')
    print(targets.check({"k": "py", "v": 1e40}, np.float32(0), "['lr']")[2])   # why 1e40 does not fit

Who calls what: `restore.restore` (on every process, in `CheckpointManager.restore`), once per
leaf of the target after the tree structures matched (`treepath.match`), before any read.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from . import format as fmt
from . import treepath

__all__ = ["kind", "check", "concrete", "abstract"]


def kind(t) -> str:
    """What a target leaf is: "host" (None, a Python scalar), "numpy", "jax" (an array or a
    ShapeDtypeStruct), or "other"."""
    if t is None or isinstance(t, (bool, int, float, str, bytes)):
        return "host"
    if isinstance(t, (np.ndarray, np.generic)):
        return "numpy"
    if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
        return "jax"
    return "other"


def _expected(rec: dict) -> str:
    if rec["k"] in ("py", "none"):
        return "None" if rec["k"] == "none" else f"{type(rec['v']).__name__} value"
    dt = f"key<{rec['prng']}>" if rec.get("prng") else rec["dt"]
    shape = rec["sh"][:len(rec["sh"]) - len(rec.get("kshape", []))] if rec.get("prng") else rec["sh"]
    return f"{dt}{list(shape)}"


def _family(v) -> str:
    """Python scalars that may stand for each other in a target: numbers, str, bytes."""
    return "bytes" if isinstance(v, bytes) else "str" if isinstance(v, str) else "number"


def _why_not_0d(v, t) -> str | None:
    """None where a saved Python number may fill a 0-d array target `t` (an abstract train state
    from `jax.eval_shape`, say, of a state saved with a Python step counter): bool into bool, an
    int into an integer dtype that holds it or a float dtype that holds it exactly, a float into a
    real float dtype whose range holds it (rounded to the dtype's precision, never to inf or 0; a
    NaN where the dtype has one).
    Else why not: " (...)" for the message, "" where `t` is no 0-d array or `v` no number."""
    if list(getattr(t, "shape", [None])) != [] or isinstance(v, (str, bytes)) or treepath.is_prng_key(t):
        return ""
    dt = np.dtype(t.dtype)
    name = fmt.dtype_name(dt)
    if isinstance(v, bool) or dt == np.bool_:
        if isinstance(v, bool) and dt == np.bool_:
            return None
        return f" (the saved value is {v!r}: a bool fills a bool array only, and a bool array takes only a bool)"
    if jax.numpy.issubdtype(dt, jax.numpy.integer):
        if not isinstance(v, int):
            return f" (the saved value {v!r} is a float: an integer array would truncate it)"
        info = jax.numpy.iinfo(dt)
        if int(info.min) <= v <= int(info.max):
            return None
        return f" (the saved value {v} is outside {name}'s range [{int(info.min)}, {int(info.max)}])"
    if not jax.numpy.issubdtype(dt, jax.numpy.floating):
        return " (a saved Python number fills a real integer or float array only)"
    try:   # rounded to the dtype, as jnp.asarray would
        with np.errstate(all="ignore"):
            r = float(np.asarray(v, dt).astype(np.float64))
    except OverflowError:   # an int beyond float64
        r = math.inf
    if isinstance(v, int):   # exactly: a step counter must not come back rounded
        if math.isfinite(r) and int(r) == v:
            return None
        return f" (the saved value {v} is not exactly representable in {name}: it would come back rounded)"
    # never to inf or 0 from a finite, non-zero value (nor to NaN: float8 types without inf), nor
    # to the largest finite value (float4/float6 types, which have neither inf nor NaN, saturate),
    # and NaN only where the dtype has a NaN (in those it became -0.0)
    if math.isnan(v):
        return None if math.isnan(r) else f" (the saved value nan would become {r!r} in {name}, which has no NaN)"
    big = float(jax.numpy.finfo(dt).max)
    if math.isfinite(v) and abs(v) > big and math.isfinite(r):
        return f" (the saved value {v!r} is outside {name}'s range [{-big!r}, {big!r}]: it would become {r!r})"
    if not math.isnan(r) and math.isinf(r) == math.isinf(v) and (r == 0) == (v == 0):
        return None
    becomes = "NaN (it has no inf)" if math.isnan(r) else "inf" if math.isinf(r) else "0" if r == 0 else repr(r)
    return f" (the saved value {v!r} would become {becomes} in {name})"


def check(rec: dict, t, where: str) -> tuple | None:
    """None where target leaf `t` can take the saved leaf `rec`, else (key path, what the checkpoint
    has, what the target expects and why not): one line of an IncompatibleCheckpointError."""
    k = kind(t)
    if t is None:   # a placeholder (e.g. a field that is None in a fresh train state): the saved value
        return None
    if rec["k"] == "none":
        return (where, "None", f"{type(t).__name__}" + (" value" if k == "host" else ""))
    if rec["k"] == "py":
        why = _why_not_0d(rec["v"], t) if k in ("numpy", "jax") else ""
        ok = _family(t) == _family(rec["v"]) if k == "host" else why is None
        has = f"{type(t).__name__}" + (" value" if k == "host" else "")
        if k in ("numpy", "jax") and not treepath.is_prng_key(t):
            has = f"{fmt.dtype_name(t.dtype)}{list(t.shape)}" + (why or "")
        return _unplaceable(t, where, _expected(rec), has) if ok else (where, _expected(rec), has)
    if k == "host":   # a Python number stands for a 0-d numeric array (a step counter after jit)
        ok = (_family(t) == "number" and rec["sh"] == [] and not rec.get("prng")
              and fmt.logical_dtype(rec["dt"]).kind != "c")
        return None if ok else (where, _expected(rec), f"{type(t).__name__} value")
    if k == "other":
        return (where, _expected(rec), f"unsupported target leaf {type(t).__name__}")
    if treepath.is_prng_key(t):
        impl = []   # the target's implementation (`key_impl` takes arrays only: a tracer is one)
        data = jax.eval_shape(lambda k: impl.append(str(jax.random.key_impl(k))) or jax.random.key_data(k), t)
        if (rec.get("prng") == impl[0] and list(data.shape) == rec["sh"]
                and fmt.dtype_name(data.dtype) == rec["dt"]):
            return _unplaceable(t, where, _expected(rec), f"key<{impl[0]}>{list(t.shape)}")
        return (where, _expected(rec), f"key<{impl[0]}>{list(t.shape)} (key data {fmt.dtype_name(data.dtype)}"
                                       f"{list(data.shape)})")
    if rec.get("prng") or list(t.shape) != rec["sh"] or fmt.dtype_name(t.dtype) != rec["dt"]:
        return (where, _expected(rec), f"{fmt.dtype_name(t.dtype)}{list(t.shape)}")
    return _unplaceable(t, where, _expected(rec), f"{fmt.dtype_name(t.dtype)}{list(t.shape)}")


def abstract(sharding) -> bool:
    """Whether `sharding` is over a `jax.sharding.AbstractMesh` (it names no devices)."""
    return isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh)


def concrete(t):
    """Target leaf `t` with a sharding jax can place arrays by. `jax.eval_shape` under
    ``jax.set_mesh(mesh)`` (explicit sharding) gives ShapeDtypeStructs whose NamedSharding is
    over ``mesh.abstract_mesh``, which names no devices (jax raised "_device_assignment is not
    implemented", naming no leaf): inside ``jax.set_mesh`` of a mesh that it abstracts, `t` on
    that mesh; else `t` itself (`check` refuses it then, naming its key path)."""
    if not isinstance(t, jax.ShapeDtypeStruct) or not abstract(s := t.sharding):
        return t
    mesh = jax.sharding.get_mesh()
    if mesh.empty or mesh.abstract_mesh != s.mesh:
        return t
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type,
                                sharding=jax.sharding.NamedSharding(mesh, s.spec, memory_kind=s.memory_kind))


def _unplaceable(t, where: str, expected: str, has: str) -> tuple | None:
    """The problem, if jax cannot make the array that target leaf `t` asks for (`has`: its dtype and
    shape, those saved): a 64-bit dtype with jax_enable_x64 off (jax would make int64 int32 and
    float64 float32: wrong values, silently), or a sharding that does not divide the shape (jax
    raised only once the leaf was read, naming no key path), judged as jax does (`shard_shape`)."""
    if kind(t) != "jax":
        return None
    if abstract(sharding := getattr(t, "sharding", None)):
        return (where, expected, f"{has} sharded over {sharding.mesh}, an abstract mesh, which names no devices "
                                 f"(restore inside `with jax.set_mesh(mesh)` of the mesh it abstracts, or give the "
                                 f"target leaf a sharding over a concrete mesh)")
    if not treepath.is_prng_key(t) and (why := _not_on_devices(t)):
        return (where, expected, f"{has} on jax, which cannot hold that dtype on {why} (restore it onto a numpy "
                                 f"array target or None: host numpy)")
    if not treepath.is_prng_key(t) and (canon := jax.dtypes.canonicalize_dtype(t.dtype)) != t.dtype:
        return (where, expected, f"{has} on jax, which makes it {fmt.dtype_name(canon)} (wrong values) while "
                                 f"jax_enable_x64 is off (enable jax_enable_x64, or restore it onto a numpy "
                                 f"array target or None: host numpy)")
    try:
        if sharding is not None:
            sharding.shard_shape(t.shape)
    except ValueError:
        return (where, expected, f"{has} sharded by {sharding}, which does not divide that shape: jax cannot "
                                 f"place it (shard it over mesh axes whose sizes divide its dimensions, or "
                                 f"replicate it)")
    return None


def _not_on_devices(t) -> str | None:
    """Where target leaf `t` asks jax for a dtype that its devices cannot hold (a ShapeDtypeStruct
    takes any ml_dtypes type: float8_e5m3fnu no jax array can be, float6 no CPU array), that
    platform ("cpu" ...); else None. Such a leaf raised jax's own error once it had been read,
    naming no key path. Asked once per dtype and platform (native dtypes never)."""
    name = fmt.dtype_name(t.dtype)
    if fmt.storage_dtype(name) == name:   # zarr's own dtypes: jax's everywhere
        return None
    sharding = getattr(t, "sharding", None)
    if sharding is not None:
        platform = next(iter(sharding.device_set)).platform
    else:
        default = jax.config.jax_default_device
        platform = default if isinstance(default, str) else (default or jax.local_devices()[0]).platform
    return None if _holds(name, platform) else platform


@functools.lru_cache(maxsize=None)
def _holds(name: str, platform: str) -> bool:
    """Whether jax puts an (empty) array of dtype `name` on a device of `platform`."""
    try:
        jax.device_put(np.zeros((0,), fmt.logical_dtype(name)), jax.local_devices(backend=platform)[0])
    except Exception:   # jax's TypeError (no jax dtype), the runtime's (no such type on this platform)
        return False
    return True
