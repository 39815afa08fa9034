"""Format v1: names, dtypes and the manifest. Specified for users in docs/format.md.

Example::

    from ckpt_callbacks import format as fmt, treepath
    fmt.step_name(42)                     # 'step_0000000042'
    empty = treepath.flatten({}).skeleton  # the tree {}: no leaves
    body = fmt.pack_manifest({"version": 1, "step": 42, "leaves": [], "tree": empty})
    fmt.unpack_manifest(body)["step"]     # 42

Who calls what: the writer (process 0) packs the manifest last; every reader unpacks and validates
it before touching any other file. Validation rejects hostile manifests (bad names, unknown
dtypes or versions, absurd shapes, oversized or nested-bomb msgpack) before anything is allocated.
"""

from __future__ import annotations

import functools
import math
import re

import crc32c as _crc32c
import ml_dtypes
import msgpack
import numpy as np

from . import layout
from .errors import CorruptCheckpointError, IncompatibleCheckpointError

__all__ = ["FORMAT_VERSION", "MANIFEST", "step_name", "parse_step_name", "pack_manifest",
           "unpack_manifest", "pack_bins", "bin_entries", "chunk_key", "chunk_nbytes", "crc32c", "storage_dtype",
           "logical_dtype", "dtype_name", "dtype_names"]

FORMAT_VERSION = 1
MAGIC = "ckpt_callbacks"
MANIFEST = "manifest.msgpack"
STEP_PREFIX = "step_"
STEP_RE = re.compile(r"^step_(\d{10})$")
STAGING_RE = re.compile(r"^step_(\d{10})\.(tmp|del|old)-[0-9a-f]{8,32}$")
ARRAY_RE = re.compile(r"^arrays/\d{1,9}$")
BLOB_RE = re.compile(r"^blobs/p\d{1,6}-\d{1,6}\.msgpack$")
HOST_RE = re.compile(r"^host/p\d{1,6}\.msgpack$")
MAX_MANIFEST_BYTES = 1 << 30
MAX_ARRAY_BYTES = 1 << 46
MAX_NDIM = 32

# dtypes tensorstore's zarr3 stores natively; every other (ml_dtypes) dtype is stored bit-cast
# to an unsigned integer of its width and viewed back on read.
_NATIVE = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64", "complex64", "complex128", "bfloat16"}
_EXOTIC = {name: getattr(ml_dtypes, name) for name in (
    "int1", "uint1", "int2", "uint2", "int4", "uint4", "float4_e2m1fn", "float6_e2m3fn",
    "float6_e3m2fn", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e5m3fnu", "float8_e8m0fnu",
    "bcomplex32", "complex32") if hasattr(ml_dtypes, name)}


def step_name(step: int) -> str:
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or not 0 <= step < 10**10:
        raise ValueError(f"step must be an int in [0, 1e10), got {step!r}")
    return f"{STEP_PREFIX}{int(step):010d}"


def parse_step_name(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, as zarr v3's crc32c codec) of any contiguous buffer, without copying it;
    `crc` continues a running one: ``crc32c(b, crc32c(a)) == crc32c(a + b)``."""
    return _crc32c.crc32c(data, crc)


def dtype_name(dtype) -> str:
    try:
        return _dtype_name(dtype)   # (once per dtype: numpy's name lookup is ~10 us, per leaf)
    except TypeError:   # unhashable
        return np.dtype(dtype).name


@functools.lru_cache(maxsize=512)
def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def dtype_names() -> list[str]:
    """The dtype names this format holds, sorted (what `logical_dtype` knows)."""
    return sorted(_NATIVE | set(_EXOTIC))


def logical_dtype(name: str) -> np.dtype:
    """numpy dtype for a saved dtype name; IncompatibleCheckpointError for unknown names."""
    if name in _NATIVE:
        return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    if name in _EXOTIC:
        return np.dtype(_EXOTIC[name])
    raise IncompatibleCheckpointError(f"unknown dtype {name!r} in checkpoint; this version knows "
                                      f"{dtype_names()}")


def storage_dtype(name: str) -> str:
    """The zarr3 data type a logical dtype is stored as."""
    if name in _NATIVE:
        return name
    return "uint%d" % (8 * logical_dtype(name).itemsize)


def chunk_nbytes(rec: dict) -> int:
    """The data bytes of one chunk of array leaf `rec` (a manifest record), as stored: a chunk
    file holds them, then their 4-byte CRC-32C."""
    return math.prod(rec["ch"]) * np.dtype(storage_dtype(rec["dt"])).itemsize


def chunk_key(idx) -> str:
    """The key of chunk `idx` (grid indices) inside a zarr3 array directory: zarr's default chunk
    key encoding, "c/i/j" ("c" for a 0-d array)."""
    return "/".join(["c", *map(str, idx)])


BLOB_ALIGN = 64   # where each packed leaf's bytes start in its blob file (CPU devices adopt them)
BLOB_PAGE = 4096               # ... and those of a leaf of at least BLOB_PAGE_MIN bytes: a
BLOB_PAGE_MIN = 64 << 10       # page-aligned copy of it goes to a disk by O_DIRECT as it is


def blob_align(nbytes: int) -> int:
    """Where a packed leaf of `nbytes` starts in its blob: at a multiple of this."""
    return BLOB_PAGE if nbytes >= BLOB_PAGE_MIN else BLOB_ALIGN


def _bin_head(size: int) -> bytes:
    return (b"\xc4" + size.to_bytes(1, "big") if size < 1 << 8 else
            b"\xc5" + size.to_bytes(2, "big") if size < 1 << 16 else b"\xc6" + size.to_bytes(4, "big"))


def pack_bins(items: list, align=1) -> tuple[list, list]:
    """A msgpack array of bin entries, as a list of buffers to write one after another, and the
    entry index of each item (the same bytes as ``msgpack.packb(items)`` when ``align`` is 1, and
    without copying the items into one buffer first).

    With ``align`` > 1 (an int, or one per item) a padding bin entry goes before each item so that
    the item's bytes start at a multiple of its ``align`` (at most 65536) in the file: a reader
    that loads the file into an aligned buffer can hand views of it to devices without copying,
    and a writer can send a page-aligned item to a disk by ``O_DIRECT`` straight from its buffer.
    Any msgpack reader sees a plain array of bins; items are found by the returned indices (the
    manifest's ``bi``)."""
    aligns = list(align) if isinstance(align, (list, tuple)) else [align] * len(items)
    padded = any(a > 1 for a in aligns)
    n = len(items) * (2 if padded else 1)
    out = [bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16
                                              else b"\xdd" + n.to_bytes(4, "big"))]
    pos, index, k = len(out[0]), [], 0
    for it, a in zip(items, aligns):
        size = memoryview(it).nbytes
        head = _bin_head(size)
        if padded:
            pad = _padding(pos, len(head), a)
            out.append(pad)
            pos, k = pos + len(pad), k + 1
        index.append(k)
        out += [head, it]
        pos, k = pos + len(head) + size, k + 1
    return out, index


def _padding(pos: int, head: int, align: int) -> bytes:
    """A bin entry of zeros after which, at offset `pos`, an entry head of `head` bytes ends at a
    multiple of `align`: a bin8 entry where its zeros are fewer than 256, else a bin16 one."""
    pad = -(pos + 2 + head) % align
    if pad < 1 << 8:
        return b"\xc4" + bytes([pad]) + bytes(pad)
    pad = -(pos + 3 + head) % align
    return b"\xc5" + pad.to_bytes(2, "big") + bytes(pad)


def bin_entries(buf) -> list[tuple[int, int]]:
    """(offset, length) of every entry of a msgpack array of bins in `buf`, without copying.
    Raises ValueError unless `buf` is exactly such an array (hostile files are refused)."""
    data = memoryview(buf).cast("B")
    end = len(data)

    def take(pos, k):
        if pos + k > end:
            raise ValueError("truncated")
        return int.from_bytes(data[pos:pos + k], "big"), pos + k

    if not end:
        raise ValueError("empty")
    tag = data[0]
    if tag & 0xF0 == 0x90:
        count, pos = tag & 0x0F, 1
    elif tag in (0xDC, 0xDD):
        count, pos = take(1, 2 if tag == 0xDC else 4)
    else:
        raise ValueError("not a msgpack array")
    entries = []
    for _ in range(count):
        if pos >= end or data[pos] not in (0xC4, 0xC5, 0xC6):
            raise ValueError("an entry is not a bin")
        size, pos = take(pos + 1, {0xC4: 1, 0xC5: 2, 0xC6: 4}[data[pos]])
        if pos + size > end:
            raise ValueError("truncated")
        entries.append((pos, size))
        pos += size
    if pos != end:
        raise ValueError("trailing bytes")
    return entries


def pack_manifest(manifest: dict) -> bytes:
    """Serialize a manifest: an outer msgpack map holding the body and the body's crc32c."""
    body = msgpack.packb(manifest, use_bin_type=True)
    return msgpack.packb({"magic": MAGIC, "version": manifest["version"], "crc32c": crc32c(body),
                          "body": body}, use_bin_type=True)


def _host_scalar(x):
    if isinstance(x, (np.integer, np.floating, np.bool_)):   # exact as Python numbers
        return x.item()
    if isinstance(x, int):
        raise TypeError(f"int {x} does not fit in 64 bits; store it as a str")
    raise TypeError(f"cannot store a {type(x).__module__}.{type(x).__qualname__}")


_MAX_HOST_DEPTH = 256   # msgpack's own limit is 512 (a cycle reaches it too)


def pack_host_state(state) -> bytes:
    """One process's host state (a data iterator's ``get_state()``, RNG state) as msgpack: dicts,
    lists (tuples come back as lists), str, bytes, bool, None, floats, ints within 64 bits, and
    numpy numbers (come back as Python numbers); dict keys not containers. Raises TypeError naming
    the first path that cannot be stored."""
    try:
        data = msgpack.packb(state, use_bin_type=True, default=_host_scalar)
    except Exception as e:  # noqa: BLE001 - located below, then raised as one TypeError
        where = _host_path(state, "host_state", _unstorable, _unstorable)
        raise TypeError(f"at {where or 'host_state'}: {e}") from None
    try:   # as it will be read (a container key comes back a list: unhashable); C speed
        msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_no_ext)
    except ValueError:   # from `_no_ext`
        raise TypeError("host_state holds a msgpack.ExtType: extension types are not part of the format") from None
    except TypeError:
        where = _host_path(state, "host_state", lambda k: isinstance(k, (tuple, list, dict)), lambda x: False)
        raise TypeError(f"at {where or 'host_state'}: dict keys must be str, int, bytes, float, bool or None") from None
    return data


def _host_path(x, path: str, bad_key, bad_leaf, depth: int = 0) -> str | None:
    """The path of the first dict key (``bad_key(k)``) or leaf (``bad_leaf(x)``) of `x` that is bad."""
    if depth > _MAX_HOST_DEPTH:
        return f"{path[:80]}... (nested over {_MAX_HOST_DEPTH} deep: a cycle?)"
    if isinstance(x, (dict, list, tuple)):
        for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
            if isinstance(x, dict) and bad_key(k):
                return f"{path} (key {k!r})"
            found = _host_path(v, f"{path}[{k!r}]", bad_key, bad_leaf, depth + 1)
            if found:
                return found
        return None
    return path if bad_leaf(x) else None


def _unstorable(x) -> bool:
    try:
        msgpack.packb(x, use_bin_type=True, default=_host_scalar)
    except Exception:  # noqa: BLE001
        return True
    return False


def _unpack(data: bytes):
    n = len(data)
    return msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=n, max_str_len=n,
                           max_array_len=n, max_map_len=n, max_ext_len=0,
                           ext_hook=_no_ext)


def _no_ext(code, data):
    raise ValueError("msgpack extension types are not part of the format")


def unpack_manifest(data: bytes, where: str = "manifest") -> dict:
    """Parse and validate a manifest; CorruptCheckpointError / IncompatibleCheckpointError on failure."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes, larger than any valid manifest")
    try:
        outer = _unpack(data)
    except Exception as e:  # msgpack raises many types for garbage input
        raise CorruptCheckpointError(f"{where} is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(outer, dict) or outer.get("magic") != MAGIC:
        raise CorruptCheckpointError(f"{where} is not a ckpt_callbacks manifest")
    body = outer.get("body")
    intact = isinstance(body, bytes) and crc32c(body) == outer.get("crc32c")
    if outer.get("version") != FORMAT_VERSION:
        # The outer version lies outside the checksum: a flipped bit there is damage, not a newer
        # format. Only a checksummed body that names the same version makes it one.
        if intact and _body_version(body) == outer.get("version"):
            raise IncompatibleCheckpointError(
                f"{where} has format version {outer.get('version')!r}; this version of ckpt_callbacks "
                f"reads version {FORMAT_VERSION}. Upgrade ckpt_callbacks to read it.")
        raise CorruptCheckpointError(f"{where}: format version {outer.get('version')!r} is not the one its "
                                     f"checksummed body records (the manifest is damaged)")
    if not intact:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (the manifest is damaged)")
    try:
        m = _unpack(body)
        _validate(m)
    except (CorruptCheckpointError, IncompatibleCheckpointError):
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{where} is malformed: {type(e).__name__}: {e}") from None
    return m


def _body_version(body: bytes):
    """The format version a manifest body records, or None where it cannot be read."""
    try:
        m = _unpack(body)
    except Exception:  # noqa: BLE001 - any garbage: no version
        return None
    return m.get("version") if isinstance(m, dict) else None


def _validate(m: dict) -> None:
    def need(cond, what):
        if not cond:
            raise CorruptCheckpointError(f"manifest is malformed: {what}")
    need(isinstance(m, dict) and m.get("version") == FORMAT_VERSION, "bad body")
    need(isinstance(m.get("step"), int) and isinstance(m.get("leaves"), list), "missing step or leaves")
    need(isinstance(m.get("tree"), dict), "missing tree")
    n = len(m["leaves"])
    for i, leaf in enumerate(m["leaves"]):
        need(isinstance(leaf, dict) and isinstance(leaf.get("p"), list), f"leaf {i}")
        for e in leaf["p"]:
            need(isinstance(e, list) and len(e) == 2 and e[0] in ("d", "i", "a", "f")
                 and isinstance(e[1], (str, int)), f"leaf {i} key path")
        kind = leaf.get("k")
        need(kind in ("array", "packed", "py", "none"), f"leaf {i} kind {kind!r}")
        if kind == "py":   # an inline Python scalar (never a container: it would come back as data)
            need("v" in leaf and isinstance(leaf["v"], (bool, int, float, str, bytes)), f"leaf {i} inline value")
        if kind in ("array", "packed"):
            logical_dtype(leaf.get("dt"))  # raises for unknown dtypes
            shape = leaf.get("sh")
            need(isinstance(shape, list) and len(shape) <= MAX_NDIM
                 and all(isinstance(d, int) and 0 <= d < 2**40 for d in shape), f"leaf {i} shape")
            need(math.prod(shape) * logical_dtype(leaf["dt"]).itemsize <= MAX_ARRAY_BYTES,
                 f"leaf {i} declares an array larger than {MAX_ARRAY_BYTES} bytes")
        if kind == "array":
            need(isinstance(leaf.get("z"), str) and ARRAY_RE.match(leaf["z"]), f"leaf {i} array name")
            ch = leaf.get("ch")
            need(isinstance(ch, list) and len(ch) == len(leaf["sh"])
                 and all(isinstance(c, int) and c >= 1 for c in ch), f"leaf {i} chunks")
            cc = leaf.get("cc")   # absent from manifests written before chunks' checksums were recorded
            need(cc is None or (isinstance(cc, list) and len(cc) == layout.chunk_count(leaf["sh"], ch)
                                and all(isinstance(c, int) and 0 <= c < 1 << 32 for c in cc)), f"leaf {i} chunk checksums")
        if kind == "packed":
            need(isinstance(leaf.get("b"), str) and BLOB_RE.match(leaf["b"]), f"leaf {i} blob name")
            need(isinstance(leaf.get("bi"), int) and isinstance(leaf.get("crc"), int), f"leaf {i} blob entry")
    _validate_tree(m["tree"], n, need)
    for name in (m.get("host") or {}).values():
        need(isinstance(name, str) and HOST_RE.match(name), "host state name")
    crcs = m.get("host_crc", {})   # absent from manifests written before host states had checksums
    need(isinstance(crcs, dict) and all(isinstance(c, int) for c in crcs.values()), "host state checksums")


def _validate_tree(tree, n, need):
    stack = [(tree, 0)]
    while stack:
        node, d = stack.pop()
        need(isinstance(node, dict) and d < 1000, "tree node")
        if "l" in node:
            need(isinstance(node["l"], int) and 0 <= node["l"] < n, "tree leaf index")
            continue
        need(node.get("t") in ("dict", "list", "tuple", "namedtuple", "node"), "tree node kind")
        need(isinstance(node.get("c"), list), "tree children")
        for c in node["c"]:
            need(isinstance(c, list) and len(c) == 2 and isinstance(c[0], list), "tree child")
            stack.append((c[1], d + 1))
