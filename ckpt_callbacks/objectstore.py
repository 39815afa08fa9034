"""Object stores (``s3://bucket/prefix``, ``gs://bucket/prefix``): commit by a marker written last.

Example::

    from ckpt_callbacks.storage import open_store
    store = open_store("s3://my-bucket/runs/exp1")   # endpoint, region, credentials: environment
    store.committed_steps()                           # steps whose commits/step_N marker exists

Who calls what: the save protocol of `ckpt_callbacks.storage` (begin on every process, publish or
abort on process 0, delete and leftovers/remove on process 0). Layout under the prefix::

    step_0000000100/...           the step, written in place (manifest, zarr3 arrays, blobs)
    commits/step_0000000100       its commit marker: written last, deleted first
    pending/step_0000000100       while a save or deletion runs: who owns step_0000000100/ now

A step is committed iff its marker exists; every reader (discovery, restore, retention) goes by the
markers only. docs/storage.md explains the credentials, endpoints, retries and what is atomic.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import time
import urllib.parse

import msgpack
import tensorstore as ts

from . import format as fmt
from . import lock
from .errors import CheckpointError, CheckpointNotFoundError, ConfigError, StorageUnavailableError
from .storage import Store

__all__ = ["ObjectStore", "redact", "MARKERS", "PENDING"]

log = logging.getLogger("ckpt_callbacks")

MARKERS = "commits/"
PENDING = "pending/"


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not 0 <= x < math.inf:   # (nan reached tensorstore's spec, and failed every request as an outage)
        raise ConfigError(f"environment variable {name}={v!r} must be a non-negative, finite number")
    return x


# Values of these variables are endpoints or credentials: never shown in a message.
_SENSITIVE_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "TENSORSTORE_GCS_HTTP_URL", "AWS_ACCESS_KEY_ID",
                  "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
_SPEC_RE = re.compile(r"\s*\[tensorstore_spec='.*?'\]", re.S)
_URL_RE = re.compile(r"\bhttps?://[^\s'\"\]\[]+")
_CONNECT_RE = re.compile(r"(connect to )\S+ port \d+")


def redact(message: str) -> str:
    """`message` without endpoints, URLs, credentials or tensorstore specs (which embed the endpoint)."""
    out = _SPEC_RE.sub("", message)
    out = _CONNECT_RE.sub(r"\1<endpoint>", out)
    out = _URL_RE.sub("<endpoint>", out)
    for name in _SENSITIVE_ENV:
        v = os.environ.get(name) or ""
        if len(v) >= 4:
            out = out.replace(v, "<redacted>")
        if "://" in v:   # the endpoint's host, where it stands as a name of its own: a bucket or key
            u = urllib.parse.urlparse(v)   # that contains it (s3://minio-ckpts with host minio) stays
            for part in sorted({u.netloc, u.hostname or ""}, key=len, reverse=True):
                if len(part) >= 4:
                    out = re.sub(rf"(?<![\w./-]){re.escape(part)}(?![\w/-]|\.\w)", "<redacted>", out)
    return out


# Tokens of the saves in flight in this process (see ObjectStore: "live saves").
_LIVE: set = set()
_HOST = socket.gethostname()


class ObjectStore(Store):
    """An s3:// or gs:// prefix through tensorstore's kvstore drivers; commit by a marker written last.

    Keys under the prefix: ``step_N/...`` (the step, written in place), ``commits/step_N`` (its
    commit marker, written last by process 0) and ``pending/step_N`` (a small record naming the
    save or deletion that owns ``step_N/`` right now: token, time, host, pid). Retries with
    exponential backoff are tensorstore's own (configured from the environment, see
    docs/storage.md), so that array chunks and small objects are retried alike; after the last one,
    every operation raises `StorageUnavailableError` naming the key and what to check.
    """

    local = False

    def __init__(self, url: str, *, retries: int | None = None, backoff_s: float | None = None,
                 max_backoff_s: float | None = None, stale_after_s: float | None = None):
        self.scheme, self.bucket, path = _split_url(url)
        self.prefix = path.strip("/") + "/" if path.strip("/") else ""
        self.url = f"{self.scheme}://{self.bucket}/{self.prefix}"
        self.retries = int(retries if retries is not None else _env_float("CKPT_CALLBACKS_IO_RETRIES", 8))
        self.backoff_s = backoff_s if backoff_s is not None else _env_float("CKPT_CALLBACKS_IO_BACKOFF_S", 0.5)
        self.max_backoff_s = (max_backoff_s if max_backoff_s is not None
                              else _env_float("CKPT_CALLBACKS_IO_MAX_BACKOFF_S", 16.0))
        self.stale_after_s = (stale_after_s if stale_after_s is not None
                              else _env_float("CKPT_CALLBACKS_STALE_AFTER_S", 7200.0))
        if self.scheme == "s3":
            _check_s3_endpoint()
        self._kv = None
        self._mine: dict[str, str] = {}   # step name -> token of this instance's save in flight

    # -- plumbing -------------------------------------------------------------------------------
    def _spec(self, path: str) -> dict:
        retries = {"max_retries": max(0, self.retries), "initial_delay": f"{self.backoff_s}s",
                   "max_delay": f"{max(self.backoff_s, self.max_backoff_s)}s"}
        if self.scheme == "gs":
            return {"driver": "gcs", "bucket": self.bucket, "path": path,
                    "context": {"gcs_request_retries": retries}}
        spec = {"driver": "s3", "bucket": self.bucket, "path": path, "context": {"s3_request_retries": retries}}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        return spec

    def kvstore(self, rel: str) -> dict:
        return self._spec(self.prefix + rel + "/")

    def redact(self, message: str) -> str:
        return redact(message)

    @property
    def kv(self):
        """The bucket's root kvstore: keys are ``self.prefix + rel`` (see `_list` for why)."""
        if self._kv is None:
            self._kv = self._io(lambda: ts.KvStore.open(self._spec("")).result(), "open")
        return self._kv

    def _io(self, fn, what: str):
        """Run one kvstore operation; tensorstore has already retried it when this raises."""
        try:
            return fn()
        except CheckpointError:   # an inner `_io`'s verdict
            raise
        except (ValueError, RuntimeError, OSError) as e:
            msg = redact(str(e))
            if re.search(r"Invalid (S3|GCS) bucket name", msg):   # a bad URL: no retry makes it work
                raise ConfigError(f"{self.url}: {msg[:200]} (see the provider's bucket naming rules)") from None
            how = "failed (not retried: the answer is final)"
            if "NOT_FOUND" in msg:
                hint = f"check that the bucket {self.bucket!r} exists"
            elif "PERMISSION_DENIED" in msg or "UNAUTHENTICATED" in msg:
                hint = "check the credentials (see docs/storage.md)"
            else:
                how = f"failed after up to {self.retries} retries with backoff"
                hint = ("check that the endpoint is reachable (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for s3, "
                        "TENSORSTORE_GCS_HTTP_URL for gs) and the network is up")
            raise StorageUnavailableError(f"{self.url}: {what} {how} ({msg[:400]}); {hint}") from None

    def write(self, rel: str, data, sync: bool = True) -> None:
        if isinstance(data, list):
            data = b"".join(data)
        self._io(lambda: self.kv.write(self.prefix + rel, data).result(), f"write {rel}")

    def read(self, rel: str) -> bytes:
        r = self._io(lambda: self.kv.read(self.prefix + rel).result(), f"read {rel}")
        if r.state != "value":
            raise CheckpointNotFoundError(f"{self.url}{rel} does not exist")
        return bytes(r.value)

    def _list(self, prefix: str) -> list[str]:
        """Keys under ``self.prefix + prefix``, relative to ``self.prefix``.

        Filtered here as well as by the server: some GCS-compatible servers ignore the key range
        tensorstore asks for and list the whole bucket (so the kvstore is opened at the bucket root,
        and keys are never trusted to lie in the requested range)."""
        full = self.prefix + prefix
        rng = _prefix_range(full) if full else ts.KvStore.KeyRange()
        keys = self._io(lambda: self.kv.list(rng).result(), f"list {prefix or '/'}")
        return sorted(k[len(self.prefix):] for k in (k.decode() for k in keys) if k.startswith(full))

    def _delete_key(self, rel: str) -> None:
        self._io(lambda: self.kv.write(self.prefix + rel, None).result(), f"delete {rel}")

    def _delete_prefix(self, prefix: str) -> None:
        """Delete every object under `prefix`, key by key (never a server-side range delete, see `_list`)."""
        keys = self._list(prefix)
        futures = [self.kv.write(self.prefix + k, None) for k in keys]
        for k, f in zip(keys, futures):
            self._io(f.result, f"delete {k}")

    def _record(self, name: str) -> dict | None:
        try:
            data = self.read(PENDING + name)
        except CheckpointNotFoundError:
            return None
        try:
            rec = msgpack.unpackb(data, raw=False)
            return rec if isinstance(rec, dict) else {}
        except Exception:  # noqa: BLE001 - a damaged record owns nothing
            return {}

    def _claim(self, name: str, op: str, token: str) -> None:
        rec = {"op": op, "token": token, "time": time.time(), "host": _HOST, "pid": os.getpid()}
        self.write(PENDING + name, msgpack.packb(rec, use_bin_type=True))

    # -- the save protocol ----------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        names = (k[len(MARKERS):] for k in self._list(MARKERS))
        return sorted(s for s in map(fmt.parse_step_name, names) if s is not None)

    def has_step(self, step: int) -> bool:
        # one listing of this step's marker key alone, not of every step's
        key = MARKERS + fmt.step_name(step)
        return key in self._list(key)

    def begin(self, step: int, token: str, lead: bool = True, reuse_tree: bool = False) -> str:
        """The lead process claims ``step_N/`` (pending record first), hides an old commit of the
        same step (``force=True``: not atomic on object stores) and clears an earlier attempt's bytes."""
        name = fmt.step_name(step)
        if lead:
            self._claim(name, "save", token)
            self._mine[name] = token
            _LIVE.add(token)
            try:
                self._delete_key(MARKERS + name)
                self._delete_prefix(name + "/")
            except BaseException:
                # the save fails before it has a staging name (nothing calls `abort`): no save owns
                # the step now, so the next start-up in this process may clean what it claimed
                self._forget(name)
                raise
        return name

    def publish(self, staging: str, step: int, replace: bool = False, pool=None) -> None:
        name = fmt.step_name(step)
        token = self._mine.get(name)
        if token is not None:
            rec = self._record(name)
            if not rec or rec.get("token") != token:
                self._forget(name)
                raise CheckpointError(
                    f"{self.url}{name}: this save's record {PENDING}{name} was removed or replaced by another "
                    f"process (a second writer on this prefix, or a start-up cleanup that judged the save dead); "
                    f"not committing. Give each run its own prefix, or raise CKPT_CALLBACKS_STALE_AFTER_S "
                    f"(now {self.stale_after_s:g}s) above your longest save.")
        # the marker names this save (its token): a reader compares it before and after reading
        # (`step_token`), so a forced replacement meanwhile is caught, not read half old, half new
        self.write(MARKERS + name, _marker(name, token or os.urandom(8).hex()))
        self._forget(name)
        try:
            self._delete_key(PENDING + name)
        except CheckpointError:  # committed; a stray record is dropped by the next start-up
            pass

    def _forget(self, name: str) -> str | None:
        token = self._mine.pop(name, None)
        _LIVE.discard(token)
        return token

    def abort(self, staging: str) -> None:
        token = self._forget(staging)
        # the marker first: a marker write that failed may still have been stored (a 503 after the
        # write); if it cannot be deleted now, the step's bytes stay (a complete step, committed).
        # A marker another save wrote (a second writer on this prefix) is left, with the step.
        marker = self.step_token(fmt.parse_step_name(staging))
        if marker is not None:
            if token is None or marker != _marker(staging, token):
                return
            self._delete_key(MARKERS + staging)
        self._delete_prefix(staging + "/")
        if token is not None and (self._record(staging) or {}).get("token") == token:
            self._delete_key(PENDING + staging)

    def step_token(self, step: int):
        """The step's marker (naming the save that committed it), or None while it is not committed."""
        try:
            return self.read(MARKERS + fmt.step_name(step))
        except CheckpointNotFoundError:
            return None

    def delete(self, step: int, reuse: bool = False) -> None:   # objects are never reused
        """Retention: record the deletion, remove the marker (the step is gone for readers), then its bytes."""
        name = fmt.step_name(step)
        self._claim(name, "delete", "del-" + os.urandom(6).hex())
        self._delete_key(MARKERS + name)
        self._delete_prefix(name + "/")
        self._delete_key(PENDING + name)

    # -- start-up cleanup -----------------------------------------------------------------------
    def _live(self, rec: dict) -> bool:
        """Might the save or deletion that wrote `rec` still be running? (see docs/storage.md)"""
        host, pid = rec.get("host"), rec.get("pid")
        if host == _HOST and pid == os.getpid():
            return rec.get("token") in _LIVE
        if host == _HOST and isinstance(pid, int):
            return lock._alive(pid)  # noqa: SLF001 - the lock's liveness rule
        t = rec.get("time")
        return isinstance(t, (int, float)) and time.time() - t < self.stale_after_s

    def leftovers(self) -> list[str]:
        """Step names whose pending record belongs to no live save or deletion."""
        out = []
        for key in self._list(PENDING):
            name = key[len(PENDING):]
            if not fmt.STEP_RE.match(name):
                continue
            rec = self._record(name)
            if rec is None:
                continue
            if self._live(rec):
                log.info("ckpt_callbacks: %s%s is being written by a live save (host %s, pid %s); left alone",
                         self.url, name, rec.get("host"), rec.get("pid"))
                continue
            out.append(name)
        return out

    def remove(self, name: str) -> None:
        """Drop a leftover: an uncommitted ``step_N/`` loses its bytes; a committed one only its record."""
        if not fmt.STEP_RE.match(name):
            raise ValueError(f"refusing to remove {name!r}: not a name ckpt_callbacks creates")
        if fmt.parse_step_name(name) not in self.committed_steps():
            self._delete_prefix(name + "/")
        self._delete_key(PENDING + name)

    def size(self, step: int) -> int | None:
        return None

    def check_writable(self) -> None:
        self._list(MARKERS)   # a missing bucket or unreachable endpoint fails here, clearly


def _check_s3_endpoint() -> None:
    """Raise `ConfigError` where the S3 endpoint variable holds no http(s) URL (``minio:9000``):
    tensorstore refused it on every request, and each refusal read as an outage, retried by a
    caller that retries outages for ever. The value is not shown (see `redact`)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        v = os.environ.get(name)
        if v:
            if not re.match(r"https?://[^/\s]", v, re.I):
                raise ConfigError(f"environment variable {name} must be an http:// or https:// URL (e.g. "
                                  f"http://minio.internal:9000); its value (not shown) is not")
            return


def _split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, path)`` of ``s3://bucket/path`` or ``gs://bucket/path``, the path taken
    literally, as the AWS and Google tools take it: ``?`` and ``#`` are part of the key (a URL
    parser dropped them, and the steps went to another prefix) and nothing is percent-decoded.

    Raises `ConfigError` for a path segment ``.`` or ``..`` (an S3 client removes it from the
    request path: the objects landed under another key, ``..`` above the prefix, while listings
    looked under this one, so every save returned and none was ever committed) and for control
    characters (which no provider accepts in a key)."""
    scheme, sep, rest = url.lstrip().partition("://")
    scheme, (bucket, _, path) = scheme.lower(), rest.partition("/")
    if scheme not in ("s3", "gs") or not sep or not bucket:
        raise ConfigError(f"{url!r}: expected s3://bucket/prefix or gs://bucket/prefix")
    if {".", ".."} & set(path.split("/")):
        raise ConfigError(f"{url!r}: a '.' or '..' segment in an object-store prefix is not a directory: S3 "
                          f"clients remove it from the request, so the objects would land under another prefix. "
                          f"Fix: write the prefix without it (e.g. {scheme}://{bucket}/runs/exp1)")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ConfigError(f"{url!r}: an object-store prefix cannot hold control characters (newline, tab, ...)")
    return scheme, bucket, path


def _marker(name: str, token: str) -> bytes:
    """The content of the commit marker of step `name` written by the save `token`."""
    return f"{name} {token}".encode()


def _prefix_range(prefix: str):
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
