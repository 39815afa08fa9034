"""Real object-store servers for tests: moto (S3 protocol) and gcp-storage-emulator (GCS JSON API).

Example (in a test module)::

    from objstore import objstore_env, s3_server, gcs_server, objstore   # noqa: F401 (fixtures)

    def test_roundtrip(objstore):                  # runs once against S3, once against GCS
        with cc.CheckpointManager(objstore.url) as m:
            m.save(1, {"w": np.ones(3)})
        assert objstore.keys() == [...]            # every object under this test's prefix

Who calls what: pytest. `objstore_env` (session) starts both servers as subprocesses on free ports
of 127.0.0.1, creates one bucket on each and points the environment at them (endpoints,
throwaway credentials, fast tensorstore retries, and every metadata/credential lookup pinned to
127.0.0.1 or disabled), so no test reaches any other address; it restores the environment and
stops the servers at the end of the session. `objstore` gives each test its own fresh prefix
(``s3://ckpt-test/<unique>`` or ``gs://ckpt-test/<unique>``). Clients reach each server through a
TCP gate on its public port: `Emulator.go_down()` / `come_back()` (or `outage()`) make the server
unreachable and reachable again at once, as a stopped and restarted server would be, while it
keeps its objects (moto keeps state only in memory, so really stopping it would lose the bucket).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import struct
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

import pytest

__all__ = ["Emulator", "Bucket", "objstore_env", "s3_server", "gcs_server", "objstore", "BUCKET",
           "SECRETS", "free_port", "two_process_save"]

BUCKET = "ckpt-test"
BIN = os.path.dirname(sys.executable)
# Throwaway credentials: long and distinctive, so a test can prove they never leak anywhere.
SECRETS = {"AWS_ACCESS_KEY_ID": "CKPTTESTKEYID0123456789",
           "AWS_SECRET_ACCESS_KEY": "ckpt-test-secret-key-9f8e7d6c5b4a",
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "ckpt-test-gcs-token-1a2b3c4d5e"}
_PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
_counter = itertools.count()


_HANDED_OUT: set = set()


def free_port() -> int:
    """A port free now and not handed out before in this process: the kernel may give a port
    just released to the next bind(0) again, and two servers were then started on one port (the
    GCS emulator's readiness probe was answered by moto, and every GCS request went to S3)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _http(method: str, url: str, timeout: float = 5.0, body: bool = False):
    """One request to a local server, never through a proxy: its status (and body, with `body`)."""
    assert url.startswith("http://127.0.0.1:"), url
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=b"" if method == "PUT" else None, method=method)
    try:
        with opener.open(req, timeout=timeout) as r:
            return (r.status, r.read()) if body else r.status
    except urllib.error.HTTPError as e:
        return (e.code, e.read()) if body else e.code


class _Gate:
    """A TCP forwarder on 127.0.0.1:`port` to the server's own port, that can be closed and reopened.

    `close()` makes the server unreachable at once (listener closed, open connections reset), as if
    it had stopped, while the server process keeps its state; `open()` brings it back on the same
    port. Bytes pass through unchanged: the client still speaks S3 / GCS to the real server.
    """

    def __init__(self, port: int, backend_port: int):
        self.port, self.backend_port = port, backend_port
        self._conns: set = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def open(self) -> None:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(256)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def _accept(self, ls) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                backend = socket.create_connection(("127.0.0.1", self.backend_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, backend}
            for a, b in ((client, backend), (backend, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._conns -= {src, dst}

    def close(self) -> None:
        if self._listener is not None:
            try:   # (close() alone leaves a thread blocked in accept() accepting: the port stayed open)
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for sock in conns:   # reset, as a dying server's kernel would
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            except OSError:
                pass


class _PortTaken(RuntimeError):
    pass


class Emulator:
    """Owns one server subprocess on 127.0.0.1 (start, outage, stop)."""

    def __init__(self, kind: str, workdir: str):
        assert kind in ("s3", "gs")
        self.kind, self.workdir = kind, workdir
        self.port = free_port()                 # what clients use: the gate
        self.server_port = free_port()          # where the server itself listens
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.gate = _Gate(self.port, self.server_port)
        self._log_from = 0   # where this start's part of the server log begins

    def _cmd(self) -> list[str]:
        if self.kind == "s3":
            return [os.path.join(BIN, "moto_server"), "-H", "127.0.0.1", "-p", str(self.server_port)]
        return [os.path.join(BIN, "gcp-storage-emulator"), "start", "-H", "127.0.0.1", "--port", str(self.server_port),
                "--in-memory", "--default-bucket", BUCKET, "-q"]

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the server; where another process took its port since `free_port` picked it (the
        server logs "Address already in use"), start it again on another port, up to 3 times."""
        self.gate.open()
        for attempt in range(3):
            log_path = os.path.join(self.workdir, f"{self.kind}-server.log")
            self._log_from = os.path.getsize(log_path) if os.path.exists(log_path) else 0
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(self._cmd(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                             env={k: v for k, v in os.environ.items() if k not in _PROXY_VARS})
            try:
                self._wait_ready(timeout_s)
                break
            except _PortTaken:
                self.proc.kill()
                self.proc.wait()
                if attempt == 2:
                    raise
                self.server_port = self.gate.backend_port = free_port()
        if self.kind == "s3":
            status = _http("PUT", f"{self.endpoint}/{BUCKET}")
            assert status == 200, f"creating bucket {BUCKET} on moto: HTTP {status}"

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        probe = f"{self.endpoint}/" if self.kind == "s3" else f"{self.endpoint}/storage/v1/b/{BUCKET}"
        # what only the right server answers, and what the other kind answers (another server on
        # the port answers too, and was taken for this one: moto answers the GCS probe with an XML
        # 404 "NoSuchBucket"); anything else: not ready yet
        mark, other = (b"ListAllMyBucketsResult", b"{") if self.kind == "s3" else (b"storage#bucket", b"<?xml")
        while True:
            if self._port_taken():
                raise _PortTaken(f"{self.kind} emulator: port {self.server_port} is taken")
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} emulator exited with {self.proc.returncode}; see "
                                   f"{self.workdir}/{self.kind}-server.log")
            try:
                status, text = _http("GET", probe, timeout=2.0, body=True)
                if status < 500 and mark in text:
                    return
                if text.lstrip().startswith(other):
                    raise _PortTaken(f"{self.kind} emulator: another server answers on port {self.server_port}")
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} emulator did not answer on {self.endpoint} in {timeout_s}s")
            time.sleep(0.05)

    def _port_taken(self) -> bool:
        try:
            with open(os.path.join(self.workdir, f"{self.kind}-server.log"), "rb") as f:
                f.seek(self._log_from)
                return b"Address already in use" in f.read()
        except OSError:
            return False

    @contextlib.contextmanager
    def outage(self):
        """The server is unreachable inside the block (connections refused or reset), back after it."""
        self.go_down()
        try:
            yield
        finally:
            self.come_back()

    def go_down(self) -> None:
        self.gate.close()

    def come_back(self) -> None:
        self.gate.open()
        self._wait_ready(30.0)

    def stop(self) -> None:
        self.gate.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Bucket:
    """One test's prefix on one server: its URL and every object under it (read independently)."""

    def __init__(self, server: Emulator, prefix: str):
        self.server, self.prefix = server, prefix
        self.url = f"{server.kind}://{BUCKET}/{prefix}"

    def _kv(self):
        """The bucket root (gcp-storage-emulator ignores the key range of a listing: filter here)."""
        import tensorstore as ts
        if self.server.kind == "s3":
            spec = {"driver": "s3", "bucket": BUCKET, "endpoint": self.server.endpoint, "aws_region": "us-east-1"}
        else:
            spec = {"driver": "gcs", "bucket": BUCKET}
        return ts.KvStore.open(spec).result()

    def keys(self) -> list[str]:
        """Every object key under this prefix (relative to it), sorted."""
        base = self.prefix + "/"
        return sorted(k[len(base):] for k in (k.decode() for k in self._kv().list().result()) if k.startswith(base))

    def read(self, key: str) -> bytes:
        r = self._kv().read(f"{self.prefix}/{key}").result()
        assert r.state == "value", f"{self.url}/{key} does not exist"
        return bytes(r.value)

    def write(self, key: str, data: bytes) -> None:
        self._kv().write(f"{self.prefix}/{key}", data).result()

    def delete(self, key: str) -> None:
        self._kv().write(f"{self.prefix}/{key}", None).result()


@pytest.fixture(scope="session")
def objstore_env():
    """Start both servers and point the environment at them; yields {"s3": Emulator, "gs": Emulator}."""
    workdir = tempfile.mkdtemp(prefix="ckpt-objstore-")
    servers = {"s3": Emulator("s3", workdir), "gs": Emulator("gs", workdir)}
    saved = dict(os.environ)
    empty = os.path.join(workdir, "empty")
    open(empty, "w").close()
    for var in _PROXY_VARS + ("GOOGLE_APPLICATION_CREDENTIALS", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        os.environ.pop(var, None)
    os.environ.update(SECRETS)
    os.environ.update({
        "AWS_ENDPOINT_URL_S3": servers["s3"].endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",            # never ask an instance-metadata service
        "AWS_CONFIG_FILE": empty, "AWS_SHARED_CREDENTIALS_FILE": empty,
        "TENSORSTORE_GCS_HTTP_URL": servers["gs"].endpoint,
        "CLOUDSDK_CONFIG": workdir,                     # no gcloud credentials file
        "GCE_METADATA_ROOT": "127.0.0.1:9",             # should anything still ask for GCE metadata
        "GCE_METADATA_HOST": "127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        # A server that hangs must fail a request in seconds, not minutes.
        "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1", "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "10",
        "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": "10",
        "CKPT_CALLBACKS_IO_RETRIES": "2", "CKPT_CALLBACKS_IO_BACKOFF_S": "0.05",
        "CKPT_CALLBACKS_IO_MAX_BACKOFF_S": "0.2",
    })
    try:
        for s in servers.values():
            s.start()
        yield servers
    finally:
        for s in servers.values():
            s.stop()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def s3_server(objstore_env):
    return objstore_env["s3"]


@pytest.fixture(scope="session")
def gcs_server(objstore_env):
    return objstore_env["gs"]


@pytest.fixture(params=["s3", "gs"])
def objstore(request, objstore_env) -> Bucket:
    """A fresh, empty prefix on the S3 server, then on the GCS server."""
    return Bucket(objstore_env[request.param], f"t{next(_counter)}-{uuid.uuid4().hex[:8]}")


def two_process_save(url: str) -> dict:
    """Run in each of 2 `jax.distributed` processes (tests/multiproc.py): save steps 1 and 2 of
    tests/multihost_worker.py's tree to `url` with KeepLast(1), then restore step 2 back."""
    import jax

    import ckpt_callbacks as cc
    import multihost_worker as mw

    pi = jax.process_index()
    m = mw.mesh((2, 4))
    with cc.CheckpointManager(url, retention=cc.KeepLast(1), timeout_s=60) as mngr:
        written = []
        for step in (1, 2):
            mngr.save(step, mw.make_tree(mw.global_values(step), m, seed=step), host_state={"pos": 10 * step + pi})
            mngr.wait_until_finished()
            written.append(mngr.last_stats.bytes_written)
        return {"process_index": pi, "steps": mngr.all_steps(), "bytes_written": written,
                "restore": mw.check(mngr.restore(target=mw.abstract(m, seed=2)), seed=2),
                "host_state": mngr.host_state()}


def two_process_open(url: str) -> dict:
    """Run in each of 2 `jax.distributed` processes: open a writing manager on `url`; the class
    of the error each process raised (None if it opened)."""
    import jax

    import ckpt_callbacks as cc

    try:
        cc.CheckpointManager(url, timeout_s=60).close()
        return {"process_index": jax.process_index(), "error": None}
    except cc.CheckpointError as e:
        return {"process_index": jax.process_index(), "error": type(e).__name__, "message": str(e),
                "unavailable": isinstance(e, cc.StorageUnavailableError)}
