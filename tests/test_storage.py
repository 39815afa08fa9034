"""Object stores on real protocol servers: moto (S3) and gcp-storage-emulator (GCS), on 127.0.0.1.

Every test runs against both servers (the `objstore` fixture of tests/objstore.py), each on its
own fresh prefix: async save, restore with resharding, retention that leaves exactly the expected
objects, a SIGKILLed save that stays invisible and is cleaned later, which leftovers start-up
cleanup spares, a server outage mid-save, and that endpoints/credentials never leak.
"""

import concurrent.futures
import logging
import os
import shutil
import queue
import subprocess
import sys
import threading

import jax
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt_callbacks as cc
from ckpt_callbacks import layout, localfs, localstore, objectstore, snapshot, storage, writing
from ckpt_callbacks.storage import open_store
from helpers import assert_tree_equal, objects_kept_by_restores
from objstore import SECRETS, gcs_server, objstore, objstore_env, s3_server  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("a", "b"))


def tree_at(step: int, sharding=None) -> dict:
    """A small train state: a sharded zarr array, a packed leaf, numpy, a PRNG key, python scalars."""
    sharding = sharding or NamedSharding(mesh((4, 2)), P("a", "b"))
    w = np.arange(512 * 640, dtype=np.float32).reshape(512, 640) * (step + 1)   # 1.3 MB: a zarr array
    return {"params": {"w": jax.device_put(w, sharding), "b": np.full(7, step, np.float32)},
            "opt": {"count": np.int64(step), "mu": np.linspace(0, 1, 50, dtype=np.float32) + step},
            "rng": jax.random.key(step), "step": step}


def step_keys(keys: list[str], step: int) -> list[str]:
    name = f"step_{step:010d}/"
    return [k[len(name):] for k in keys if k.startswith(name)]


def test_redact_removes_endpoints_specs_and_secrets(objstore_env):
    ep = objstore_env["s3"].endpoint
    msg = (f"ABORTED: Error reading \"x\": CURL error: Failed to connect to 127.0.0.1 port 4711 "
           f"[tensorstore_spec='{{\"endpoint\":\"{ep}\"}}'] while fetching {ep}/ckpt-test/x "
           f"with key {SECRETS['AWS_SECRET_ACCESS_KEY']}")
    out = objectstore.redact(msg)
    assert out == ('ABORTED: Error reading "x": CURL error: Failed to connect to <endpoint> while fetching '
                   '<endpoint> with key <redacted>')


def test_redaction_keeps_a_prefix_or_bucket_that_contains_the_endpoint_host(objstore, monkeypatch):
    """With a MinIO endpoint http://minio:9000, messages named s3://<redacted>-ckpts/...: the
    endpoint's host was cut out of every word holding it, the bucket and the keys included."""
    var = "AWS_ENDPOINT_URL_S3" if objstore.server.kind == "s3" else "TENSORSTORE_GCS_HTTP_URL"
    monkeypatch.setenv(var, f"http://localhost:{objstore.server.port}")
    url = objstore.url + "/localhost-run"
    with cc.CheckpointManager(url, async_save=False) as m:
        m.save(1, {"w": np.ones(3)})
        with objstore.server.outage():
            with pytest.raises(cc.CheckpointSaveError) as info:
                m.save(2, {"w": np.ones(3)})
    msg = str(info.value)
    assert f"{url}/: " in msg and str(objstore.server.port) not in msg, msg
    port = objstore.server.port
    out = objectstore.redact(f"Could not resolve host: localhost; localhost:{port} refused; key localhost-run/x")
    assert out == "Could not resolve host: <redacted>; <redacted> refused; key localhost-run/x"


def test_a_write_that_timed_out_on_an_object_store_is_storage_unavailable(objstore_env, tmp_path):
    """A chunk write to a server that hangs fails in tensorstore with a ValueError naming no endpoint;
    it reached a failed save as that ValueError, where the docs promise StorageUnavailableError."""
    timeout = ValueError('ABORTED: Error writing "run/step_0000000002/arrays/0/c/0/0": All 2 retry attempts '
                         'failed: CURL error Timeout was reached: Operation too slow. [curl_code=\'28\']')
    got = open_store("s3://ckpt-test/run").scrub(timeout)
    assert isinstance(got, cc.StorageUnavailableError) and "Timeout was reached" in str(got)
    assert open_store(str(tmp_path)).scrub(timeout) is timeout   # a local store's errors are its own
    other = ValueError("INVALID_ARGUMENT: not about the storage")
    assert open_store("s3://ckpt-test/run").scrub(other) is other


def test_async_save_then_restore_resharded(objstore):
    tree = tree_at(3)
    host = tree["params"]["b"]
    with cc.CheckpointManager(objstore.url, async_save=True) as m:
        assert m.save(3, tree, metrics={"loss": 0.25})
        host[:] = -1                                   # mutated after save() returned: not saved
        m.wait_until_finished()
        assert m.all_steps() == [3] and m.metrics(3) == {"loss": 0.25}
    expected = tree_at(3)
    for shape, spec in (((2, 4), P("a", "b")), ((8, 1), P("a", None))):
        sh = NamedSharding(mesh(shape), spec)
        target = jax.tree.map(lambda x: x, tree_at(0, sh))
        out = cc.CheckpointManager(objstore.url, read_only=True).restore(target=target)
        assert_tree_equal(out, tree_at(3, sh))
        assert out["params"]["w"].sharding == sh
    plain = cc.CheckpointManager(objstore.url, read_only=True).restore()
    assert np.array_equal(plain["params"]["w"], np.asarray(expected["params"]["w"]))
    assert objstore.keys()[:1] == ["commits/step_0000000003"]
    assert not [k for k in objstore.keys() if k.startswith("pending/")]


@pytest.mark.usefixtures("zarr_above_1mib")
def test_retention_leaves_exactly_the_kept_steps(objstore):
    with cc.CheckpointManager(objstore.url, retention=cc.KeepLast(2)) as m:
        for step in range(1, 6):
            m.save(step, tree_at(step))
        m.wait_until_finished()
        assert m.all_steps() == [4, 5]
        assert [list(s.deleted) for s in m.history] == [[], [], [1], [2], [3]]
    keys = objstore.keys()
    one_step = step_keys(keys, 5)
    assert "manifest.msgpack" in one_step and any(k.startswith("arrays/") for k in one_step)
    assert keys == sorted(["commits/step_0000000004", "commits/step_0000000005"]
                          + [f"step_0000000004/{k}" for k in one_step] + [f"step_0000000005/{k}" for k in one_step])
    assert_tree_equal(cc.CheckpointManager(objstore.url, read_only=True).restore(4, target=tree_at(0)), tree_at(4))


@pytest.mark.usefixtures("zarr_above_1mib")
def test_repeated_restores_and_verifies_keep_no_objects(objstore):
    """As on a local directory (test_restore): a restore or verify of an array leaf kept ~11
    objects for good, through tensorstore's leaking Spec.to_json()."""
    with cc.CheckpointManager(objstore.url) as m:
        m.save(1, tree_at(1))
    m = cc.CheckpointManager(objstore.url, read_only=True)
    assert objects_kept_by_restores(m, 1, rounds=10) < 100


CHILD = r"""
import os, signal, sys
import numpy as np
import ckpt_callbacks as cc
from ckpt_callbacks import objectstore
url = sys.argv[1]
def tree(s):
    return {"w": np.arange(100_000, dtype=np.float32) + s, "step": s}
m = cc.CheckpointManager(url, async_save=False)
for s in (1, 2, 3):
    m.save(s, tree(s))
def die(self, staging, step, replace=False, pool=None):   # all bytes and the manifest are written: die now
    os.kill(os.getpid(), signal.SIGKILL)
objectstore.ObjectStore.publish = die
m.save(4, tree(4))
"""


def test_killed_save_is_invisible_then_cleaned_and_run_resumes(objstore):
    r = subprocess.run([sys.executable, "-c", CHILD, objstore.url], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == -9, r.stderr[-3000:]
    keys = objstore.keys()
    assert "commits/step_0000000004" not in keys
    assert "pending/step_0000000004" in keys and "step_0000000004/manifest.msgpack" in keys
    ro = cc.CheckpointManager(objstore.url, read_only=True)
    assert ro.all_steps() == [1, 2, 3] and ro.latest_step() == 3
    with pytest.raises(cc.CheckpointNotFoundError):
        ro.restore(4)
    assert step_keys(objstore.keys(), 4)            # read-only: nothing is cleaned
    with cc.CheckpointManager(objstore.url) as m:   # start-up: the dead writer's step 4 goes
        assert not step_keys(objstore.keys(), 4) and "pending/step_0000000004" not in objstore.keys()
        start = m.latest_step()
        assert start == 3
        out = m.restore(target={"w": np.zeros(100_000, np.float32), "step": 0})
        assert_tree_equal(out, {"w": np.arange(100_000, dtype=np.float32) + 3, "step": 3})
        assert m.save(4, {"w": out["w"] + 1, "step": 4})
        m.wait_until_finished()
        assert m.all_steps() == [1, 2, 3, 4]
    assert not [k for k in objstore.keys() if k.startswith("pending/")]


def _record(host, pid, age_s, token="abc"):
    import time
    return msgpack.packb({"op": "save", "token": token, "time": time.time() - age_s, "host": host, "pid": pid})


def test_cleanup_removes_only_leftovers_no_live_save_owns(objstore):
    import socket
    me = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live_here = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cases = {10: (me, dead.pid, 0), 11: (me, live_here.pid, 10**6), 12: ("other-host", 1, 60),
                 13: ("other-host", 1, 3 * 3600), 14: (me, os.getpid(), 0)}
        for step, (host, pid, age) in cases.items():
            objstore.write(f"pending/step_{step:010d}", _record(host, pid, age))
            objstore.write(f"step_{step:010d}/blobs/p0-0.msgpack", b"partial")
        objstore.write("step_0000000099/blobs/p0-0.msgpack", b"no record: not known to be ours")
        objstore.write("notes/step_0000000010", b"not ours")
        store = open_store(objstore.url)
        # 10: this host, pid dead; 13: another host, older than CKPT_CALLBACKS_STALE_AFTER_S (2h);
        # 14: this very process, but no save of it is in flight. 11 (pid alive) and 12 (recent) stay.
        assert store.leftovers() == ["step_0000000010", "step_0000000013", "step_0000000014"]
        with cc.CheckpointManager(objstore.url):
            pass
        left = {k.split("/")[0] + "/" + k.split("/")[1] for k in objstore.keys()}
        assert left == {"pending/step_0000000011", "pending/step_0000000012", "step_0000000011/blobs",
                        "step_0000000012/blobs", "step_0000000099/blobs", "notes/step_0000000010"}
    finally:
        live_here.kill()
        live_here.wait()


def test_a_save_that_fails_right_after_its_claim_leaves_nothing_live_to_clean(objstore):
    """begin() claimed the step, then could not clear it (an outage): the save failed, but its
    token stayed live for the rest of the process, so a new manager here never removed the record."""
    with cc.CheckpointManager(objstore.url) as m:
        m.save(1, tree_at(1))
        m.wait_until_finished()
        real = m.store._list

        def outage(prefix):
            if prefix.startswith("step_"):
                raise cc.StorageUnavailableError(f"{objstore.url}: list {prefix} failed (simulated outage)")
            return real(prefix)
        m.store._list = outage
        with pytest.raises(cc.CheckpointSaveError, match="simulated outage"):
            m.save(2, tree_at(2))
            m.wait_until_finished()
        m.store._list = real
    assert "pending/step_0000000002" in objstore.keys()
    with cc.CheckpointManager(objstore.url) as m:   # the next start in this process cleans it
        assert m.all_steps() == [1]
    assert not [k for k in objstore.keys() if k.startswith("pending/")]


def test_a_save_whose_claim_was_taken_is_not_committed(objstore):
    """A cleanup that (wrongly) judged a slow save dead removes its record: the save must fail."""
    store = open_store(objstore.url)
    snap = snapshot.plan({"w": np.ones(5, np.float32)})
    items: queue.SimpleQueue = queue.SimpleQueue()
    snapshot.copy(snap, items.put)
    real_write = store.write

    def write(rel, data, sync=True):
        if rel.endswith("manifest.msgpack"):
            objstore.delete("pending/step_0000000007")   # another process's cleanup, mid-save
        real_write(rel, data, sync)

    store.write = write
    with pytest.raises(cc.CheckpointSaveError, match="was removed or replaced by another process"):
        writing.write_and_commit(store, 7, snap, items, token="a1b2c3d4e5f6")
    assert "commits/step_0000000007" not in objstore.keys()
    assert open_store(objstore.url).committed_steps() == []


def _has_step_agrees_with_the_listing(url):
    with cc.CheckpointManager(url, async_save=False) as m:
        for step in (5, 50, 500):
            m.save(step, {"x": np.arange(3.0)})
    store = open_store(url)
    store.delete(50)
    assert store.committed_steps() == [5, 500]
    # the committed steps and no other (a deleted one neither)
    assert [s for s in (0, 5, 50, 500, 5000) if store.has_step(s)] == [5, 500]


def test_has_step_answers_as_the_listing_does_on_an_object_store(objstore):
    _has_step_agrees_with_the_listing(objstore.url)


def test_has_step_answers_as_the_listing_does_on_a_local_directory(tmp_path):
    _has_step_agrees_with_the_listing(str(tmp_path / "run"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(cc.CheckpointError, match="is a file"):
        localstore.LocalStore(str(tmp_path / "file")).has_step(1)


class _Feed:
    """The writer's item queue; `on_first` runs when the writer takes its first item (mid-save:
    the pending record and the zarr metadata are written, no chunk yet)."""

    def __init__(self, tree, on_first):
        self.snap = snapshot.plan(tree)
        self.items: list = []
        snapshot.copy(self.snap, self.items.append)
        self.on_first = on_first

    def get(self):
        if self.on_first:
            self.on_first, f = None, self.on_first
            f()
        return self.items.pop(0)


@pytest.mark.parametrize("var,value", [("CKPT_CALLBACKS_IO_RETRIES", "-1"), ("CKPT_CALLBACKS_IO_BACKOFF_S", "nan"),
                                       ("CKPT_CALLBACKS_IO_MAX_BACKOFF_S", "-5"), ("CKPT_CALLBACKS_STALE_AFTER_S", "inf"),
                                       ("CKPT_CALLBACKS_IO_RETRIES", "three")])
def test_a_retry_variable_that_is_no_non_negative_finite_number_is_a_config_error(objstore, monkeypatch, var, value):
    """BACKOFF_S=nan reached tensorstore's spec, and every request then failed as an outage
    ("check that the endpoint is reachable"); a negative count or delay was taken as it was."""
    monkeypatch.setenv(var, value)
    with pytest.raises(cc.ConfigError, match=f"{var}={value!r} must be a non-negative, finite number"):
        cc.CheckpointManager(objstore.url)
    monkeypatch.delenv(var)
    with cc.CheckpointManager(objstore.url) as m:
        m.save(1, {"a": 1})
    assert cc.CheckpointManager(objstore.url, read_only=True).restore(1) == {"a": 1}


def test_server_outage_mid_save_fails_clearly_without_marker_then_recovers(objstore, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    with cc.CheckpointManager(objstore.url) as m:
        m.save(1, tree_at(1))
    monkeypatch.setenv("CKPT_CALLBACKS_IO_RETRIES", "2")
    store = open_store(objstore.url)
    feed = _Feed(tree_at(2), objstore.server.go_down)
    try:
        with pytest.raises(cc.CheckpointSaveError) as info:
            writing.write_and_commit(store, 2, feed.snap, feed, token="0badc0ffee00")
    finally:
        objstore.server.come_back()
    msg = str(info.value)
    assert "save of step 2 failed and was not committed" in msg and "check that the endpoint is reachable" in msg
    assert "All 2 retry attempts failed" in msg
    ep = objstore.server.endpoint
    assert ep not in msg and str(objstore.server.port) not in msg and "tensorstore_spec" not in msg
    assert str(objstore.server.port) not in repr(info.value.__cause__)
    # an outage, typed as one (the message redacted of the endpoint keeps its class)
    assert isinstance(info.value.__cause__, cc.StorageUnavailableError)
    assert info.value.failures[0].startswith("StorageUnavailableError"), info.value.failures
    # the server is back: step 2 has no marker; the next save works; start-up removes step 2's bytes
    assert "commits/step_0000000002" not in objstore.keys()
    monkeypatch.delenv("CKPT_CALLBACKS_IO_RETRIES")
    with cc.CheckpointManager(objstore.url) as m:
        assert m.all_steps() == [1]
        m.save(3, tree_at(3))
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]
        assert_tree_equal(m.restore(target=tree_at(0)), tree_at(3))
    with cc.CheckpointManager(objstore.url):
        pass
    keys = objstore.keys()
    assert not step_keys(keys, 2) and not [k for k in keys if k.startswith("pending/")]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert ep not in logged and str(objstore.server.port) not in logged


@pytest.mark.parametrize("url", ["s3://", "gs://", "s3:///prefix"])
def test_an_object_store_url_without_a_bucket_is_a_config_error(url):
    with pytest.raises(cc.ConfigError, match="expected s3://bucket/prefix"):
        cc.CheckpointManager(url)


def test_a_prefix_holding_query_or_fragment_characters_is_taken_literally(objstore):
    """``?`` and ``#`` are key characters to S3 and GCS (and to their own tools); a URL parser cut
    them off, and ``.../run?v=2`` saved into ``.../run/``, over another run's steps."""
    with cc.CheckpointManager(objstore.url + "/run", retention=cc.KeepLast(1)) as other:
        other.save(1, {"w": np.zeros(3)})
    for suffix in ("/run?v=2", "/run#2", "/rün 2/x"):
        with cc.CheckpointManager(objstore.url + suffix, retention=cc.KeepLast(1)) as m:
            m.save(5, {"w": np.arange(3.0)})
        assert cc.CheckpointManager(objstore.url + suffix, read_only=True).all_steps() == [5]
        # the scheme's case and leading blanks, as a URL parser reads them
        assert cc.CheckpointManager(" " + objstore.url.upper()[:2] + objstore.url[2:] + suffix,
                                    read_only=True).all_steps() == [5]
    keys = objstore.keys()
    for prefix in ("run?v=2/", "run#2/", "rün 2/x/"):
        assert prefix + "commits/step_0000000005" in keys
    assert cc.CheckpointManager(objstore.url + "/run", read_only=True).all_steps() == [1]


@pytest.mark.parametrize("suffix", ["/./run", "/a/../run", "/..", "/run/.", "/run\nx", "/run\tx"])
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_dot_segment_or_control_character_in_a_prefix_is_a_config_error(scheme, suffix):
    """S3 clients drop ``.`` / ``..`` segments from the request path: the objects of ``s3://b/x/./run``
    landed under ``x/run/`` (``..``: above the prefix) while its listings looked under ``x/./run/``,
    so every save returned, and no step was ever committed."""
    with pytest.raises(cc.ConfigError, match="segment|control characters"):
        cc.CheckpointManager(f"{scheme}://ckpt-test/x{suffix}")


def test_a_file_url_is_taken_literally_and_needs_a_path(tmp_path, monkeypatch):
    """file:///ckpt/run#2 opened /ckpt/run (a URL parser cut the fragment off: another run's
    checkpoints, resumed from), and file:// opened the working directory, which "" refuses."""
    with cc.CheckpointManager(str(tmp_path / "run")) as other:
        other.save(1, {"w": np.zeros(3)})
    for name in ("run#2", "run?v=2"):
        with cc.CheckpointManager(f"file://{tmp_path}/{name}") as m:
            assert m.all_steps() == []
            m.save(7, {"w": np.ones(3)})
        assert cc.CheckpointManager(str(tmp_path / name), read_only=True).all_steps() == [7]
    assert cc.CheckpointManager(str(tmp_path / "run"), read_only=True).all_steps() == [1]
    monkeypatch.chdir(tmp_path / "run")
    for url in ("file://", "file:", "file://localhost"):
        with pytest.raises(cc.ConfigError, match="needs a path"):
            cc.CheckpointManager(url)
    assert sorted(os.listdir(tmp_path / "run")) == ["step_0000000001"]


_OPEN_CHILD = """
import sys, time
import ckpt_callbacks as cc
t = time.monotonic()
try:
    cc.CheckpointManager(sys.argv[1])
except cc.StorageUnavailableError as e:
    print(f"{time.monotonic() - t:.1f}", e)
"""


@pytest.mark.slow
def test_a_server_that_never_answers_fails_each_attempt_after_the_documented_60_s():
    """docs/storage.md gave curl's own defaults (no limit on a silent transfer) for the time after
    which a hung server fails a request; tensorstore's are 60 s below 256 bytes/s. Measured here
    with those defaults (and no retry): a manager opened against a server that accepts
    connections and never answers raises StorageUnavailableError after about 60 s, never hangs."""
    import socket
    import time
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSTORE_", "AWS_", "CKPT_CALLBACKS_"))}
    env.update(AWS_ENDPOINT_URL_S3=url, TENSORSTORE_GCS_HTTP_URL=url, AWS_REGION="us-east-1", PYTHONPATH=ROOT,
               AWS_EC2_METADATA_DISABLED="true", NO_PROXY="127.0.0.1", CKPT_CALLBACKS_IO_RETRIES="0", **SECRETS)
    held = []

    def accept():   # hold every connection open, answer nothing
        try:
            while True:
                held.append(silent.accept()[0])
        except OSError:
            pass
    threading.Thread(target=accept, daemon=True).start()
    t0 = time.monotonic()
    children = [subprocess.Popen([sys.executable, "-c", _OPEN_CHILD, f"{kind}://ckpt-test/run"], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for kind in ("s3", "gs")]
    try:
        outs = [c.communicate(timeout=150)[0] for c in children]
    finally:
        for c in children:
            c.kill()
        silent.close()
    for out in outs:
        took, _, msg = out.strip().partition(" ")
        assert 55 <= float(took) <= 100 and "Timeout was reached" in msg, out
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_an_s3_endpoint_without_http_scheme_is_a_config_error_not_an_outage(s3_server, monkeypatch, var):
    """AWS_ENDPOINT_URL_S3=host:port (no scheme) failed every request as StorageUnavailableError
    "failed after up to N retries ... check that the endpoint is reachable": a caller retrying on
    outages retried it for ever, and nothing was retried at all."""
    hostport = s3_server.endpoint[len("http://"):]
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv(var, hostport)
    with pytest.raises(cc.ConfigError, match=f"{var} must be an http:// or https:// URL") as info:
        cc.CheckpointManager("s3://ckpt-test/run")
    assert hostport not in str(info.value) and not isinstance(info.value, cc.StorageUnavailableError)
    monkeypatch.setenv(var, s3_server.endpoint)
    with cc.CheckpointManager("s3://ckpt-test/scheme-ok", async_save=False) as m:   # the same server, with its scheme
        m.save(1, {"w": np.ones(3)})


def _retries(objstore) -> int:
    """Requests tensorstore has retried so far on this kind of store (a process-wide counter)."""
    import tensorstore as ts
    kind = "s3" if objstore.server.kind == "s3" else "gcs"
    for m in ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{kind}/retries"):
        return sum(v.get("value", 0) for v in m["values"])
    return 0


def test_a_brief_outage_mid_save_is_ridden_out_by_retries(objstore, monkeypatch):
    monkeypatch.setenv("CKPT_CALLBACKS_IO_RETRIES", "8")
    monkeypatch.setenv("CKPT_CALLBACKS_IO_BACKOFF_S", "0.2")
    monkeypatch.setenv("CKPT_CALLBACKS_IO_MAX_BACKOFF_S", "1")
    store = open_store(objstore.url)
    come_back = threading.Timer(1.0, objstore.server.come_back)   # well within the ~6 s retry budget
    retries_before = _retries(objstore)

    def go_down_briefly():
        objstore.server.go_down()
        come_back.start()

    feed = _Feed(tree_at(5), go_down_briefly)
    try:
        writing.write_and_commit(store, 5, feed.snap, feed, token="00c0ffee0bad")
    finally:
        come_back.join()
    assert _retries(objstore) > retries_before
    assert open_store(objstore.url).committed_steps() == [5]
    assert_tree_equal(cc.CheckpointManager(objstore.url, read_only=True).restore(target=tree_at(0)), tree_at(5))


def test_no_endpoint_or_credential_in_objects_logs_or_errors(objstore, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    with cc.CheckpointManager(objstore.url, retention=cc.KeepLast(1)) as m:
        m.save(1, tree_at(1), metrics={"loss": 1.0})
        m.save(2, tree_at(2), metrics={"loss": 0.5})
        m.wait_until_finished()
        m.restore(target=tree_at(0))
    with pytest.raises(cc.CheckpointError) as info:
        cc.CheckpointManager(objstore.url.replace("ckpt-test", "no-such-bucket-here"))
    assert "no-such-bucket-here" in str(info.value)
    err = capfd.readouterr().err
    sensitive = [objstore.server.endpoint, f"127.0.0.1:{objstore.server.port}", *SECRETS.values()]
    blobs = b"".join(objstore.read(k) for k in objstore.keys())
    for s in sensitive:
        assert s.encode() not in blobs, s
        assert s not in str(info.value), s
        assert s not in "\n".join(r.getMessage() for r in caplog.records), s
        assert s not in err, s


@pytest.mark.usefixtures("zarr_above_1mib")
def test_outage_mid_restore_is_unavailable_storage_never_a_fallback(objstore, monkeypatch, capsys):
    from ckpt_callbacks import cli
    from ckpt_callbacks import restore as restore_mod
    with cc.CheckpointManager(objstore.url) as m:
        m.save(1, tree_at(1))
        m.save(2, tree_at(2))
    monkeypatch.setenv("CKPT_CALLBACKS_IO_RETRIES", "1")
    real = restore_mod.leaf_reader._check_backing

    def go_down_after_listing(self, rec, where):   # the chunks are listed, then their reads fail
        real(self, rec, where)
        objstore.server.go_down()

    monkeypatch.setattr(restore_mod.leaf_reader, "_check_backing", go_down_after_listing)
    m = cc.CheckpointManager(objstore.url, read_only=True)
    try:
        with pytest.raises(cc.StorageUnavailableError) as info:
            m.restore(target=tree_at(0), fallback=True)   # step 2 is fine: no fallback to step 1
        assert m.restored_step is None
        assert not isinstance(info.value, cc.CorruptCheckpointError) and isinstance(info.value, OSError)
        msg = str(info.value)
        assert "['params']['w']" in msg and "not known to be damaged" in msg
        assert objstore.server.endpoint not in msg and str(objstore.server.port) not in msg
        monkeypatch.setattr(restore_mod.leaf_reader, "_check_backing", real)
        # verify cannot tell damage from an outage it cannot read through: it fails, it says nothing is damaged
        assert cli.main(["verify", objstore.url]) == 1
        out, err = capsys.readouterr()
        assert "StorageUnavailableError" in err and "DAMAGED" not in out
        objstore.server.come_back()
        from ckpt_callbacks import verify
        real_manifest = verify.read_manifest

        def go_down_after_manifest(store, step):   # the steps are listed, their chunks cannot be read
            m = real_manifest(store, step)
            objstore.server.go_down()
            return m

        monkeypatch.setattr(verify, "read_manifest", go_down_after_manifest)
        assert cli.main(["verify", objstore.url]) == 1
        out, err = capsys.readouterr()
        assert "StorageUnavailableError" in err and "not known to be damaged" in err and "DAMAGED" not in out
    finally:
        objstore.server.come_back()
    assert_tree_equal(m.restore(target=tree_at(0), fallback=True), tree_at(2))
    assert m.restored_step == 2
    m.close()


def test_two_process_save_to_s3_writes_one_marker(s3_server):
    from multiproc import launch

    import multihost_worker as mw
    from objstore import Bucket

    bucket = Bucket(s3_server, f"two-proc-{os.getpid()}")
    res = launch("objstore:two_process_save", 2, devices_per_process=4, args={"url": bucket.url}, timeout_s=240)
    assert all(r.ok for r in res), "\n".join(f"{r.process_index}: {r.error}\n{r.traceback}\n{r.output[-2000:]}"
                                              for r in res)
    for pi, r in enumerate(res):
        assert r.result["steps"] == [2] and r.result["restore"] == []
        assert r.result["host_state"] == {"pos": 20 + pi}
        assert all(n > 0 for n in r.result["bytes_written"])     # both processes wrote shards
    keys = bucket.keys()
    assert [k for k in keys if not k.startswith("step_0000000002/")] == ["commits/step_0000000002"]
    assert {"step_0000000002/host/p0.msgpack", "step_0000000002/host/p1.msgpack"} <= set(keys)
    from ckpt_callbacks.restore import read_manifest
    arrays = [r for r in read_manifest(open_store(bucket.url), 2)["leaves"] if r["k"] == "array"]
    assert arrays and all(len(r["cc"]) == layout.chunk_count(r["sh"], r["ch"]) for r in arrays)   # both processes'
    # the pytest process (1 process x 8 devices) restores what 2 x 4 wrote, bit-exactly
    m = mw.mesh((4, 2))
    restored = cc.CheckpointManager(bucket.url, read_only=True).restore(target=mw.abstract(m, seed=2))
    assert mw.check(restored, seed=2) == []


def test_a_missing_bucket_at_start_up_is_storage_unavailable_on_every_process(s3_server):
    """Process 0 checks the store for all: it raised StorageUnavailableError, the other processes
    a plain CheckpointError, so a job that retries its start on an unavailable store (and stops on
    anything else) retried on process 0 alone, which then waited for peers that had left."""
    from multiproc import launch

    res = launch("objstore:two_process_open", 2, devices_per_process=4, timeout_s=180,
                 args={"url": "s3://no-such-bucket-ckpt/run"})
    assert all(r.ok for r in res), [r.describe() for r in res]
    assert [(r.result["error"], r.result["unavailable"]) for r in res] == [("StorageUnavailableError", True)] * 2
    assert "no-such-bucket-ckpt" in res[1].result["message"] and "process 0" in res[1].result["message"]


def test_cli_lists_verifies_and_collects_an_object_store(objstore, capsys):
    from ckpt_callbacks import cli

    with cc.CheckpointManager(objstore.url) as m:
        for step in (1, 2, 3):
            m.save(step, tree_at(step), metrics={"loss": 1.0 / step})
    objstore.write("pending/step_0000000004", _record("other-host", 1, 3 * 3600))   # a stale leftover
    objstore.write("step_0000000004/manifest.msgpack", b"partial")
    assert cli.main(["ls", objstore.url]) == 0
    listing = capsys.readouterr().out
    assert all(f"{s}" in listing for s in (1, 2, 3))
    assert cli.main(["verify", objstore.url]) == 0
    assert cli.main(["gc", objstore.url, "--keep-last", "1", "--remove-partial"]) == 0
    capsys.readouterr()
    assert open_store(objstore.url).committed_steps() == [3]
    assert {k.split("/")[0] for k in objstore.keys()} == {"commits", "step_0000000003"}


@pytest.mark.usefixtures("zarr_above_1mib")
def test_an_intact_chunk_object_of_another_save_is_refused_on_an_object_store(objstore):
    """Tensorstore checks each chunk against the CRC the chunk carries; the manifest's record of
    every chunk's CRC (computed by the writer for what tensorstore writes) is compared with the
    chunk's last 4 bytes, so a chunk object of step 1 under step 2 is refused by restore and verify."""
    from ckpt_callbacks import verify
    from ckpt_callbacks.restore import read_manifest
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    sh = NamedSharding(mesh, P("a", "b"))
    rng = np.random.default_rng(0)
    xs = [jax.device_put(rng.standard_normal((512, 600), np.float32), sh) for _ in range(2)]
    flags = rng.integers(0, 2, (1200, 1000)).astype(bool)   # a zarr array of bools, not chunked by shards
    with cc.CheckpointManager(objstore.url, async_save=False) as m:
        for step, x in ((1, xs[0]), (2, xs[1])):
            m.save(step, {"w": x, "f": flags if step == 1 else ~flags})
    recs = {r["p"][0][1]: r for r in read_manifest(open_store(objstore.url), 2)["leaves"]}
    assert len(recs["w"]["cc"]) == 8 and len(recs["f"]["cc"]) == 1
    key = f"{recs['w']['z']}/c/2/1"
    objstore.write(f"step_0000000002/{key}", objstore.read(f"step_0000000001/{key}"))
    m = cc.CheckpointManager(objstore.url, read_only=True)
    with pytest.raises(cc.CorruptCheckpointError, match=r"\['w'\]: chunk .*c/2/1 is intact but is not the chunk"):
        m.restore(2, target={"w": xs[1], "f": flags})
    assert [p for p, _ in verify.verify_step(open_store(objstore.url), 2)] == ["['w']"]
    assert_tree_equal(m.restore(1, target={"w": xs[0], "f": flags}), {"w": xs[0], "f": flags})


@pytest.mark.usefixtures("zarr_above_1mib")
def test_force_resave_replaces_a_committed_step_without_stale_objects(objstore):
    with cc.CheckpointManager(objstore.url, async_save=False) as m:
        m.save(1, {"a": np.arange(300_000, dtype=np.float32), "b": np.ones(3)})
        before = step_keys(objstore.keys(), 1)
        assert not m.save(1, {"c": np.zeros(2)})                       # committed: skipped
        assert m.save(1, {"c": np.zeros(2, np.int8)}, force=True)      # replaced
        assert_tree_equal(m.restore(1), {"c": np.zeros(2, np.int8)})
    after = step_keys(objstore.keys(), 1)
    assert any(k.startswith("arrays/") for k in before) and not any(k.startswith("arrays/") for k in after)
    assert objstore.keys() == ["commits/step_0000000001"] + [f"step_0000000001/{k}" for k in after]


def test_a_marker_write_that_failed_after_the_server_stored_it_leaves_no_step(objstore, monkeypatch):
    """A 503 (or a timeout) after the server stored the marker: the save fails, and its abort
    deleted the step's objects but not the marker, leaving a committed step without data."""
    real = objectstore.ObjectStore.write

    def write(self, rel, data, sync=True):
        real(self, rel, data, sync)
        if rel == objectstore.MARKERS + "step_0000000002":
            raise cc.StorageUnavailableError("HTTP 503 (the object was stored)")

    monkeypatch.setattr(objectstore.ObjectStore, "write", write)
    with cc.CheckpointManager(objstore.url, async_save=False) as m:
        m.save(1, {"a": np.ones(3)})
        with pytest.raises(cc.CheckpointSaveError, match="not committed"):
            m.save(2, {"a": np.arange(300_000, dtype=np.float32)})
    assert cc.CheckpointManager(objstore.url, read_only=True).all_steps() == [1]
    assert not [k for k in objstore.keys() if "step_0000000002" in k]


def test_a_forced_replacement_during_a_restore_is_caught_never_returned_half_old_half_new(objstore, monkeypatch):
    from ckpt_callbacks import restore as restore_mod
    old = {f"l{i}": np.full(300_000, 1.0, np.float32) for i in range(4)}   # chunk files, read one by one
    new = {k: v + 1 for k, v in old.items()}
    writer = cc.CheckpointManager(objstore.url, async_save=False)
    writer.save(5, old)
    real, calls = restore_mod._restore_leaf, []

    def leaf(reader, rec, t):   # another process replaces the step while this one reads it
        calls.append(rec)
        if len(calls) == 3:
            writer.save(5, new, force=True)
        return real(reader, rec, t)

    monkeypatch.setattr(restore_mod, "_restore_leaf", leaf)
    with pytest.raises(cc.CheckpointNotFoundError, match="deleted or replaced while it was being restored"):
        cc.CheckpointManager(objstore.url, read_only=True).restore(5)
    monkeypatch.setattr(restore_mod, "_restore_leaf", real)
    assert_tree_equal(cc.CheckpointManager(objstore.url, read_only=True).restore(5), new)
    writer.close()


@pytest.mark.usefixtures("zarr_above_1mib")
def test_claim_all_takes_a_kept_file_for_every_size_or_none(tmp_path):
    store = open_store(str(tmp_path / "ck"))
    with cc.CheckpointManager(store.root) as m:
        m.save(1, {"a": np.ones((512, 1024), np.float32), "b": np.ones((1024, 1024), np.float32)})
    store.delete(1, reuse=True)                        # keeps a 2 MiB + 4 and a 4 MiB + 4 chunk file
    two, four = (2 << 20) + 4, (4 << 20) + 4
    assert store.claim_all([two, two]) is None         # only one of that size: nothing is taken
    got = store.claim_all([four, two])
    assert [os.path.getsize(p) for p in got] == [four, two]
    assert store.claim(two) is None and store.claim(four) is None
    store.drop_reusable()
    assert not [n for n in os.listdir(store.root) if ".del-" in n]


@pytest.mark.usefixtures("zarr_above_1mib")
def test_kept_files_nobody_claimed_are_deleted_on_the_pool_given(tmp_path):
    store = open_store(str(tmp_path / "ck"))
    with cc.CheckpointManager(store.root) as m:
        for s in (1, 2):
            m.save(s, {f"a{i}": np.full((512, 1024), i, np.float32) for i in range(6)})
    store.delete(1, reuse=True)
    store.delete(2, reuse=True)
    assert store.claim((2 << 20) + 4)                  # one file taken: the rest is still kept
    left = sum(len(fs) for _, _, fs in os.walk(store.root))
    unlinked, real = [], os.unlink
    with concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="given") as pool:
        def unlink(path):
            unlinked.append(threading.current_thread().name)
            real(path)
        localstore.os.unlink = unlink
        try:
            store.drop_reusable(pool)
        finally:
            localstore.os.unlink = real
    assert len(unlinked) == left > 2 * 6 and all(n.startswith("given") for n in unlinked)
    assert os.listdir(store.root) == []


def test_a_local_store_bypasses_the_page_cache_only_on_a_local_disk_and_maps_only_on_a_memory_one(tmp_path):
    mnt = tmp_path / "a tmpfs"          # /proc/self/mounts writes the space as \040
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        assert localfs.fs_type(str(mnt / "ck" / "not yet")) == "tmpfs"
        assert open_store(str(mnt / "ck")).direct_io is False
        assert open_store(str(mnt / "ck")).in_memory is True
        beside = localfs.fs_type(str(tmp_path / "ck"))
        assert beside and beside == localfs.fs_type(str(tmp_path))   # (ck does not exist yet)
        assert open_store(str(tmp_path / "ck")).direct_io is (beside in localfs.DIRECT_FS)
        assert open_store(str(tmp_path / "ck")).in_memory is (beside in localfs.MEMORY_FS)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_an_outage_of_the_test_servers_refuses_new_connections(s3_server):
    """The outage tests rely on it: a closed gate whose accept thread still waited kept accepting."""
    import socket
    with s3_server.outage():
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", s3_server.port), timeout=5).close()
    socket.create_connection(("127.0.0.1", s3_server.port), timeout=5).close()


def test_deleting_a_step_never_leaves_its_replaced_copy_to_be_put_back(tmp_path, monkeypatch):
    """A forced replacement's `.old-` copy (its removal was interrupted) goes with its step, even
    where it cannot be removed now (NFS's silly renames, EBUSY): it must not become recoverable."""
    store = open_store(str(tmp_path / "ck"))
    with cc.CheckpointManager(store.root) as m:
        m.save(1, {"a": np.ones(3)})
    os.makedirs(store.path("step_0000000001.old-0123456789ab/arrays"))
    monkeypatch.setattr(localfs.shutil, "rmtree", lambda *a, **k: None)   # nothing can be removed
    store.delete(1)
    assert store.recoverable() == {} and store.committed_steps() == []
    assert store.recover() == [] and store.committed_steps() == []


def test_submit_runs_a_refused_task_here_and_never_a_queued_one_twice(monkeypatch):
    """`storage.submit`: a pool that refuses the task before queueing it (shut down, as every pool
    is at interpreter exit) -> the task runs on the caller's thread; a pool that queued it and
    then could not start a thread -> the error is raised and the task is not run here too."""
    ran = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pool.shutdown()
    fut = storage.submit(pool, lambda x: ran.append((x, threading.current_thread().name)) or x * 2, 21)
    assert fut.done() and fut.result() == 42 and ran == [(21, threading.current_thread().name)]
    failing = storage.submit(pool, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result()

    ran.clear()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        storage.submit(pool, ran.append, 1)
    assert ran == []   # queued in the pool, not run here as well


@pytest.mark.parametrize("url", ["s3://b/run", "gs://Not_A_Bucket/run"])
def test_an_invalid_bucket_name_is_a_config_error_not_an_outage(url):
    # a caller retrying on StorageUnavailableError would retry a bad URL for ever
    with pytest.raises(cc.ConfigError, match="bucket name") as info:
        cc.CheckpointManager(url)
    assert not isinstance(info.value, cc.StorageUnavailableError)
    assert str(info.value).count(url) == 1, str(info.value)   # said once, not once per layer


def test_an_open_managers_metrics_of_a_step_whose_manifest_went_raise_on_an_object_store(objstore):
    """On an object store nothing cheap says a step changed (a local directory's stamp does), so an
    open manager answered `metrics(step)` from what it had read or saved, after the manifest was gone."""
    with cc.CheckpointManager(objstore.url, retention=[cc.KeepLast(2), cc.KeepBest("l", "min")]) as m:
        m.save(1, {"a": np.arange(3.0)}, metrics={"l": 1.0})
        m.save(2, {"a": np.arange(3.0)}, metrics={"l": 2.0})
        m.wait_until_finished()
        assert m.metrics(1) == {"l": 1.0}
        objstore.delete("step_0000000001/manifest.msgpack")
        with pytest.raises(cc.CorruptCheckpointError, match="manifest cannot be read"):
            m.metrics(1)
        assert m.all_steps() == [1, 2] and m.metrics(2) == {"l": 2.0}


def test_a_test_server_started_on_a_port_another_server_holds_moves_to_another(tmp_path):
    """CI once ran every GCS test against moto: the GCS emulator's port was the one moto had (the
    kernel hands a just-released port to the next bind(0) again), and moto's 404 answered the
    emulator's readiness probe. The fixture's servers now prove who they are."""
    import objstore as objstore_mod
    s3 = objstore_mod.Emulator("s3", str(tmp_path))
    gs = objstore_mod.Emulator("gs", str(tmp_path))
    s3.start()
    try:
        gs.server_port = gs.gate.backend_port = s3.server_port   # the collision
        gs.start()
        assert gs.server_port != s3.server_port
        status, body = objstore_mod._http("GET", f"{gs.endpoint}/storage/v1/b/{objstore_mod.BUCKET}", body=True)
        assert status == 200 and b"storage#bucket" in body
    finally:
        gs.stop()
        s3.stop()
    assert len({objstore_mod.free_port() for _ in range(200)}) == 200   # never the same port twice


def test_a_file_where_a_directory_belongs_is_said_or_removed(tmp_path):
    """A read-only manager on a file: a CheckpointError (was a raw NotADirectoryError). A step a
    user replaced by a file, replaced again with force=True: the file goes (it stayed as a
    `.tmp-` leftover that start-up's rmtree could not remove)."""
    f = tmp_path / "a file"
    f.write_bytes(b"x")
    with pytest.raises(cc.CheckpointError, match="is a file, not a checkpoint directory"):
        cc.CheckpointManager(str(f), read_only=True).all_steps()
    d = str(tmp_path / "ck")
    with cc.CheckpointManager(d) as m:
        m.save(1, {"a": np.ones(3)})
    step = os.path.join(d, "step_0000000001")
    shutil.rmtree(step)
    open(step, "wb").close()
    with cc.CheckpointManager(d) as m:
        assert m.save(1, {"a": np.zeros(3)}, force=True)
    assert os.listdir(d) == ["step_0000000001"]
    np.testing.assert_array_equal(cc.CheckpointManager(d, read_only=True).restore(1)["a"], np.zeros(3))
