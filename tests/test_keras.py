"""AsyncCheckpoint (ckpt_callbacks/keras.py) with real Keras 3 `model.fit` on the JAX backend.

The interruption tests run tests/keras_train_script.py in subprocesses, SIGKILL it, re-run it
unchanged and compare its final state bit for bit with a run that never had a checkpoint callback.
"""

import contextlib
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ckpt_callbacks as cc  # noqa: E402
from ckpt_callbacks.keras import AsyncCheckpoint  # noqa: E402
from ckpt_callbacks.keras_data import ResumableDataset  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "keras_train_script.py")
ENV = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
ENV.pop("XLA_FLAGS", None)


# -- helpers --------------------------------------------------------------------------------------
def _script(out, *args):
    return subprocess.Popen([sys.executable, SCRIPT, str(out), *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(p, timeout=240):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _kill_when(p, ckdir, ready, timeout=240):
    """SIGKILL `p` as soon as the committed steps in `ckdir` satisfy `ready`; return those steps."""
    deadline = time.monotonic() + timeout
    mngr = None
    while time.monotonic() < deadline:
        assert p.poll() is None, "the run finished before it could be interrupted: " + p.stderr.read()[-2000:]
        if mngr is None and os.path.isdir(ckdir):
            mngr = cc.CheckpointManager(ckdir, read_only=True)
        steps = mngr.all_steps() if mngr else []
        if ready(steps):
            p.send_signal(signal.SIGKILL)
            p.communicate()
            assert p.returncode == -signal.SIGKILL
            return steps
        time.sleep(0.005)
    p.kill()
    raise AssertionError("timed out waiting for a checkpoint")


def _assert_npz_equal(a, b):
    a, b = np.load(a), np.load(b)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Final states of uninterrupted runs without any checkpoint callback (both run at once)."""
    d = tmp_path_factory.mktemp("ref")
    procs = {kind: _script(d / f"{kind}.npz", "--data", kind, "--sleep", "0") for kind in ("numpy", "pydataset")}
    return {kind: (d / f"{kind}.npz", _finish(p)) for kind, p in procs.items()}


# -- interruption ---------------------------------------------------------------------------------
def test_sigkill_after_an_epoch_resumes_bit_exact(tmp_path, references):
    """numpy inputs with fit(shuffle=True) + Dropout: killed after epoch 2's checkpoint, re-run
    unchanged: it resumes at the next epoch by itself (weights, Adam state incl. iteration, seed
    generator, numpy's shuffle RNG) and ends bit-identical to a run without checkpointing."""
    ck, args = str(tmp_path / "ck"), ["--data", "numpy", "--ckpt", str(tmp_path / "ck")]
    steps = _kill_when(_script(tmp_path / "a.npz", *args), ck, lambda s: bool(s) and s[-1] >= 16)
    assert all(s % 8 == 0 for s in steps)                 # epoch-end saves only (8 batches an epoch)
    assert not (tmp_path / "a.npz").exists()
    info = _finish(_script(tmp_path / "b.npz", *args))
    assert info["resumed_step"] >= 16 and info["initial_batch"] == 0
    assert info["initial_epoch"] == info["resumed_step"] // 8 and info["epochs_run"] == 6 - info["initial_epoch"]
    ref_npz, ref_info = references["numpy"]
    _assert_npz_equal(tmp_path / "b.npz", ref_npz)
    assert info["last_logs"] == ref_info["last_logs"]


def test_sigkill_mid_epoch_resumes_at_next_unseen_batch_bit_exact(tmp_path, references):
    """save_freq=3 batches with a ResumableDataset (seeded shuffle): killed right after a mid-epoch
    checkpoint, the re-run continues at the next unseen batch of that epoch, with that epoch's running
    metrics, and ends bit-identical (state and last epoch's logs) to a run without checkpointing."""
    ck = str(tmp_path / "ck")
    args = ["--data", "pydataset", "--save-freq", "3", "--ckpt", ck]
    _kill_when(_script(tmp_path / "a.npz", *args), ck, lambda s: any(x > 8 and x % 8 for x in s))
    info = _finish(_script(tmp_path / "b.npz", *args))
    assert info["initial_batch"] > 0, info               # resumed inside an epoch
    assert info["resumed_step"] == 8 * info["initial_epoch"] + info["initial_batch"]
    ref_npz, ref_info = references["pydataset"]
    _assert_npz_equal(tmp_path / "b.npz", ref_npz)
    assert info["last_logs"] == ref_info["last_logs"]


# -- in-process: distribution, strictness, retention ----------------------------------------------
def _model(units=16, extra=False, seed=0, clear=True):
    if clear:   # same auto-generated names (seed generators); it also clears the distribution scope
        keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((8,)), keras.layers.Dense(units, activation="relu", name="d1")]
    if extra:
        layers.append(keras.layers.Dense(units, name="d3"))
    layers.append(keras.layers.Dense(1, name="d2"))
    model = keras.Sequential(layers, name="net")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


def _data(n=64, flip_val=False):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n + 16, 8)).astype("float32")
    y = (x @ rng.standard_normal((8, 1))).astype("float32")
    if flip_val:
        y[n:] = -y[n:]
    return x[:n], y[:n], (x[n:], y[n:])


def _state(model):
    """path -> (value, sharding); the optimizer's auto-numbered name ("adam_1") written as "adam"."""
    opt = model.optimizer.name
    return {v.path.replace(opt + "/", "adam/", 1): (np.asarray(v.value), v.value.sharding) for v in
            model.trainable_variables + model.non_trainable_variables + model.optimizer.variables}


@pytest.mark.parametrize("kind", ["ModelParallel", "DataParallel"])
def test_distributed_save_and_resume_keeps_layouts(ckdir, devices, kind):
    """ModelParallel with a LayoutMap on 2x4 CPU devices (and DataParallel on 8): variables are saved
    sharded and a fresh model resumes with every value bit-equal and every variable on its layout."""
    if kind == "ModelParallel":
        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
        layout = keras.distribution.LayoutMap(mesh)
        layout[".*/d1/kernel"] = (None, "model")
        layout[".*/d1/bias"] = ("model",)
        layout[".*/d2/kernel"] = ("model", None)
        dist = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    else:
        dist = keras.distribution.DataParallel(devices=devices)
    x, y, val = _data()
    keras.backend.clear_session()
    with dist.scope():
        a = _model(units=32, seed=1, clear=False)
        a.fit(x, y, batch_size=16, epochs=2, validation_data=val, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
        saved = _state(a)
        kernel = a.get_layer("d1").kernel.value
        assert len(kernel.sharding.device_set) == 8
        if kind == "ModelParallel":
            assert not kernel.sharding.is_fully_replicated and kernel.addressable_shards[0].data.shape == (8, 8)
        b = _model(units=32, seed=2, clear=False)
        cb = AsyncCheckpoint(ckdir)
        b.fit(x, y, batch_size=16, epochs=2, validation_data=val, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 8 and cb.initial_epoch == 2
    got = _state(b)
    assert got.keys() == saved.keys()
    for path, (value, sharding) in saved.items():
        assert got[path][0].tobytes() == value.tobytes(), path
        assert got[path][1].is_equivalent_to(sharding, value.ndim), (path, got[path][1], sharding)
    m = cc.CheckpointManager(ckdir, read_only=True).restore()   # the manifest kept the mesh layout
    assert m["model"]["trainable_variables"]["net"]["d1"]["kernel"].shape == (8, 32)


def test_mismatched_model_is_refused_and_nothing_is_loaded(ckdir):
    x, y, val = _data()
    _model().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
    for other, expect in [(dict(units=12), ["d1']['kernel", "d1']['bias", "shape"]),
                          (dict(extra=True), ["d3", "target has it: yes"])]:
        model = _model(**other, seed=3)
        model.build((None, 8))
        model.optimizer.build(model.trainable_variables)
        before = {v.path: np.asarray(v.value).copy() for v in model.trainable_variables}
        with pytest.raises(cc.IncompatibleCheckpointError) as e:
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
        msg = str(e.value)
        assert "does not match checkpoint step 4" in msg and all(s in msg for s in expect), msg
        assert e.value.mismatches
        after = {v.path: np.asarray(v.value) for v in model.trainable_variables}
        assert all(before[k].tobytes() == after[k].tobytes() for k in before)   # no partial load


def test_a_fit_that_raises_never_leaves_the_directory_locked_for_the_next_callback(ckdir, caplog):
    """As in a notebook: a cell's fit() raises (a mismatched model; another callback), the user
    fixes it and runs the cell again with a new AsyncCheckpoint on the same directory."""
    x, y, val = _data()
    _model().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
    failed = AsyncCheckpoint(ckdir)
    with pytest.raises(cc.IncompatibleCheckpointError):   # on_train_begin raises: it closes what it opened
        _model(units=12).fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[failed])
    assert not os.path.exists(os.path.join(ckdir, ".ckpt_callbacks.lock"))

    class Boom(keras.callbacks.Callback):   # raises at the end of the first epoch it sees (after our save)
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("boom")

    def abandon(epochs):
        left = AsyncCheckpoint(ckdir)   # Keras calls no on_train_end when fit() raises: its manager stays open
        with pytest.raises(RuntimeError, match="boom"):
            _model().fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[left, Boom()])
        return left

    left = abandon(4)
    assert os.path.exists(os.path.join(ckdir, ".ckpt_callbacks.lock"))
    with pytest.raises(cc.CheckpointLockedError, match=r"fit\(\) raised.*cb\.manager\.close\(\)"):
        cc.CheckpointManager(ckdir)   # the user's own manager is told which one holds it, and how to free it
    cb = AsyncCheckpoint(ckdir)
    with caplog.at_level("WARNING", logger="ckpt_callbacks"):
        _model().fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[cb])
    assert "closing the checkpoint manager that another AsyncCheckpoint left open" in caplog.text
    assert cb.resumed_step == 8 and cb.manager.all_steps() == [4, 8, 12]
    assert not os.path.exists(os.path.join(ckdir, ".ckpt_callbacks.lock"))
    with pytest.raises(cc.CheckpointError, match="closed"):   # the abandoned callback's manager
        left.manager.save(99, {"x": 1})

    t = threading.Thread(target=abandon, args=(5,))   # a fit that raised on a thread that has ended
    t.start()
    t.join()
    cb = AsyncCheckpoint(ckdir)
    _model().fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 16 and cb.manager.latest_step() == 20

    held = []   # that callback garbage-collected while its manager lives on (held here, or in a cycle)
    t = threading.Thread(target=lambda: held.extend((lambda cb: (weakref.ref(cb), cb.manager))(abandon(6))))
    t.start()
    t.join()
    gc.collect()
    assert held[0]() is None   # the callback is gone
    cb = AsyncCheckpoint(ckdir)
    _model().fit(x, y, batch_size=16, epochs=7, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 24 and cb.manager.latest_step() == 28 and held[1]._closed

    # the same directory written another way (a file:// URL, a trailing slash) is the same one:
    # the manager left open is closed, not refused as a lock that another manager holds
    left = abandon(8)
    cb = AsyncCheckpoint("file://" + ckdir + "/")
    _model().fit(x, y, batch_size=16, epochs=9, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 32 and cb.manager.latest_step() == 36 and left.manager._closed


def test_one_directory_written_two_ways_is_one_directory_to_the_callbacks(tmp_path):
    from ckpt_callbacks.keras import _dir_key
    assert _dir_key("s3://b/run") == _dir_key("s3://b/run/") != _dir_key("s3://b/run2")
    assert _dir_key("gs://b/run/") == _dir_key("gs://b/run") != _dir_key("s3://b/run")
    assert _dir_key(tmp_path / "run") == _dir_key(f"file://{tmp_path}/run/") == _dir_key(f"{tmp_path}/x/../run")



def test_two_async_checkpoints_in_one_fit_are_refused_before_the_second_opens_anything(ckdir):
    """A fast local callback beside a remote one: each restored its own latest step into the model
    (the model held one's step, the data the other's position) and numbered its saves from that."""
    x, y, _ = _data()
    other = ckdir + "-other"
    model = _model()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
    kernel = model.get_layer("d1").kernel
    kernel.assign(np.zeros(kernel.shape, "float32"))   # a restore of step 8 would change it
    for dirs in ((ckdir, ckdir), (other, ckdir), (ckdir, other)):
        first, second = AsyncCheckpoint(dirs[0]), AsyncCheckpoint(dirs[1])
        with pytest.raises(cc.ConfigError, match="this fit\\(\\) has two AsyncCheckpoint callbacks"):
            model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[first, second])
        assert first.manager is None and second.manager is None   # nothing opened, nothing restored
        assert not os.path.exists(os.path.join(ckdir, ".ckpt_callbacks.lock")) and not os.path.exists(other)
        # (a restore had left model._initial_epoch at 2: every later fit() of it began there)
        assert not np.asarray(kernel.value).any() and model._initial_epoch is None
    assert model.fit(x, y, batch_size=16, epochs=1, verbose=0).epoch == [0]
    cb = AsyncCheckpoint(ckdir)
    _model().fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 8 and cb.manager.all_steps() == [4, 8, 12]


def test_a_resumed_fit_that_another_callback_moves_to_another_epoch_is_refused(ckdir, tmp_path):
    """Keras' BackupAndRestore listed after AsyncCheckpoint, its backup ahead of the last committed
    step (a kill before the save committed): it loaded its weights over the restored ones and set
    another first epoch, and fit() trained on from that mix, its saves numbered from the older step."""
    x, y, _ = _data()
    backup = str(tmp_path / "backup")
    model = _model()
    model.fit(x, y, batch_size=16, epochs=3, verbose=0,
              callbacks=[AsyncCheckpoint(ckdir), keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    cc.CheckpointManager(ckdir).close()
    shutil.rmtree(os.path.join(ckdir, "step_0000000012"))   # the last save had not committed
    model = _model()
    cb = AsyncCheckpoint(ckdir)
    with pytest.raises(cc.ConfigError, match="fit\\(\\) began epoch 4"):
        model.fit(x, y, batch_size=16, epochs=5, verbose=0,
                  callbacks=[cb, keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)])
    assert cb.resumed_step == 8 and cb.manager._closed and model._initial_epoch is None
    cb = AsyncCheckpoint(ckdir)   # listed after it, AsyncCheckpoint's restore wins: one consistent state
    model.fit(x, y, batch_size=16, epochs=4, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False), cb])
    assert cb.resumed_step == 8 and cb.manager.all_steps() == [4, 8, 12, 16]
    assert int(model.optimizer.iterations.numpy()) == 16


def test_an_epoch_whose_data_ran_out_before_steps_per_epoch_is_saved_as_ended(ckdir):
    """Keras trains on when the data runs out before `steps_per_epoch` (with a warning); no
    `stop_training`: each epoch has ended, and is saved so (it was taken for a stopped epoch)."""
    x, y, _ = _data()
    model = _model()
    cb = AsyncCheckpoint(ckdir, data=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=8, steps_per_epoch=20, epochs=3, verbose=0, callbacks=[cb])
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert m.all_steps() == [8, 16, 24]
    assert [int(m.restore(s)["progress"]["batch"]) for s in m.all_steps()] == [0, 0, 0]


def test_a_model_whose_state_keras_cannot_collect_fails_before_training(ckdir):
    """Two weights of a layer with one name: Keras' get_state_tree() refuses them. That came as
    Keras' ValueError at the first save, after an epoch of training."""
    class TwoW(keras.layers.Layer):
        def build(self, shape):
            self.a = self.add_weight((shape[-1], 1), initializer="zeros", name="w")
            self.b = self.add_weight((shape[-1], 1), initializer="ones", name="w")

        def call(self, t):
            return t @ self.a + t @ self.b

    class Count(keras.callbacks.Callback):
        batches = 0

        def on_train_batch_end(self, batch, logs=None):
            Count.batches += 1

    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((8,)), TwoW()])
    model.compile("sgd", "mse")
    x, y, _ = _data()
    with pytest.raises(cc.ConfigError, match="(?s)found twice.*Fix: give each variable of a layer its own name"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Count(), AsyncCheckpoint(ckdir)])
    assert Count.batches == 0 and not os.path.exists(os.path.join(ckdir, ".ckpt_callbacks.lock"))


def test_an_epoch_whose_loss_is_not_finite_is_not_saved(ckdir, caplog):
    """Weights that produced a NaN loss are no place to resume from; retention would otherwise
    delete the last good step to make room for them."""
    x, y, val = _data()
    model = _model()

    class Poison(keras.callbacks.Callback):   # the weights go NaN during epoch 3
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                for v in model.trainable_variables:
                    v.assign(np.full(v.shape, np.nan, "float32"))

    class Slow(keras.callbacks.Callback):   # batch-end hooks that lag behind the steps (Keras runs them
        async_safe = True                   # on its own threads): a mid-epoch save read a stale loss

        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.2)

    cb = AsyncCheckpoint(ckdir, keep_last=1, save_freq=2, data=False)
    with caplog.at_level("WARNING", logger="ckpt_callbacks"):
        hist = model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[Poison(), Slow(), cb])
    assert np.isnan(hist.history["loss"][2]) and "not saving epoch 3: its loss is nan" in caplog.text
    assert "not saving step 10 (inside epoch 3): its loss is nan" in caplog.text   # mid-epoch saves too
    assert cb.manager.all_steps() == [8]
    restored = cc.CheckpointManager(ckdir, read_only=True).restore(8)
    assert all(np.isfinite(v).all() for v in jax.tree_util.tree_leaves(restored["model"]["trainable_variables"]))


def test_mode_auto_finds_the_direction_of_a_multi_output_models_metrics(ckdir):
    keras.backend.clear_session()
    inp = keras.Input((8,))
    h = keras.layers.Dense(4, activation="relu")(inp)
    model = keras.Model(inp, {"a": keras.layers.Dense(1, activation="sigmoid", name="a")(h),
                              "b": keras.layers.Dense(1, name="b")(h)})
    model.compile(optimizer="adam", loss={"a": "binary_crossentropy", "b": "mse"},
                  metrics={"a": ["accuracy"], "b": ["mae"]})
    x, y, _ = _data()
    labels = {"a": (y > 0).astype("float32"), "b": y}
    for monitor, mode in [("val_a_accuracy", "max"), ("val_b_mae", "min"), ("val_a_loss", "min")]:
        cb = AsyncCheckpoint(os.path.join(ckdir, monitor), monitor=monitor, keep_best=1)
        model.fit(x, labels, batch_size=16, epochs=1, validation_split=0.25, verbose=0, callbacks=[cb])
        assert [(p.metric, p.mode) for p in cb.manager.policies] == [(monitor, mode)]


def test_keep_last_and_keep_best_on_val_loss_leave_exactly_the_expected_steps(ckdir):
    """keep_last=2 + keep_best=1 on val_loss, validation only every 2nd epoch: the survivors are the two
    newest steps plus the epoch-end step with the lowest val_loss; epochs without val_loss never rank."""
    x, y, val = _data(flip_val=True)      # val targets negated: val_loss grows as the model learns
    cb = AsyncCheckpoint(ckdir, keep_last=2, keep_best=1)
    hist = _model().fit(x, y, batch_size=16, epochs=6, validation_data=val, validation_freq=2, verbose=0,
                        callbacks=[cb])
    val_loss = hist.history["val_loss"]          # epochs 2, 4, 6 -> steps 8, 16, 24
    best = [8, 16, 24][int(np.argmin(val_loss))]
    assert best not in (20, 24), "the data should make an early epoch best"
    mngr = cc.CheckpointManager(ckdir, read_only=True, retention=cc.KeepBest("val_loss"))
    assert mngr.all_steps() == sorted({20, 24, best})
    assert cb.manager.best_step() == best == mngr.best_step()
    assert "val_loss" not in mngr.metrics(20) and mngr.metrics(best)["val_loss"] == pytest.approx(min(val_loss))
    assert cb.best == pytest.approx(min(val_loss))


@pytest.mark.parametrize("steps_per_execution, steps", [(1, [3, 6, 8, 11, 14, 16]), (2, [4, 8, 12, 16])])
def test_batch_end_hook_runs_off_the_main_thread_and_saves_stay_exact(ckdir, steps_per_execution, steps):
    """The callback is async_safe: Keras calls its batch-end hook on a thread of its own instead of
    turning every batch's logs into floats first (which waits for each step). The saves, decided on
    the main thread at batch begin and epoch end, still land exactly: save_freq=3, 8 batches per
    epoch, also when Keras runs 2 steps per call."""
    threads = set()

    class Probe(AsyncCheckpoint):
        def on_train_batch_end(self, batch, logs=None):
            threads.add(threading.current_thread() is threading.main_thread())
            super().on_train_batch_end(batch, logs)

    x, y, _ = _data(n=128)
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=steps_per_execution)
    cb = Probe(ckdir, save_freq=3, data=False)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    assert threads == {False}
    assert cb.manager.all_steps() == steps
    mngr = cc.CheckpointManager(ckdir, read_only=True)
    progress = {s: mngr.restore(s)["progress"] for s in steps}
    assert [(int(p["epoch"]), int(p["batch"]), int(p["global_step"])) for p in progress.values()] == [
        (s // 8, s % 8, s) for s in steps]   # epoch ends: (next epoch, batch 0)


def test_initial_value_threshold_bars_steps_from_best(ckdir, capsys):
    """No val_loss can beat a threshold of 0: no step ranks as best, only keep_last keeps."""
    x, y, val = _data()
    cb = AsyncCheckpoint(ckdir, keep_last=1, keep_best=1, initial_value_threshold=0.0)
    _model().fit(x, y, batch_size=16, epochs=3, validation_data=val, verbose=0, callbacks=[cb])
    assert cb.manager.all_steps() == [12] and cb.manager.best_step() is None
    assert cb.manager.metrics(12)["val_loss"] > 0 and cb.best == 0.0
    # `ckpt-callbacks ls` ranks as the run did (it marked step 12 best, ignoring the threshold)
    from ckpt_callbacks import cli
    assert cli.main(["ls", ckdir, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["best"]["step"] is None and listing["best"]["threshold"] == 0.0
    assert not [r for r in listing["steps"] if r["best"]]


def test_resumable_dataset_order_skip_and_epochs():
    class Idx(keras.utils.PyDataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.full((2, 1), i, "float32"), np.zeros((2, 1), "float32")

    ds = ResumableDataset(Idx(), shuffle_seed=5)
    order = ds.batch_order(3)
    assert sorted(order) == list(range(10)) and list(order) != list(range(10))
    ds.set_position(3, skip=4)
    assert ds.num_batches == 6 and [int(ds[i][0][0, 0]) for i in range(6)] == list(order[4:])
    with pytest.raises(IndexError):
        ds[6]
    ds.on_epoch_begin()
    ds[0]
    ds.on_epoch_end()          # Keras peeking at one batch is not an epoch
    assert (ds.epoch, ds.num_batches) == (3, 6)
    ds.on_epoch_begin()
    [ds[i] for i in range(6)]
    ds.on_epoch_end()          # a complete pass: the next epoch, from its first batch
    assert (ds.epoch, ds.num_batches) == (4, 10)
    with pytest.raises(cc.ConfigError):
        ds.set_position(0, skip=11)


class _Indexed(keras.utils.PyDataset):
    """Batch i holds the value i in every row (8 batches of 4 rows)."""

    def __init__(self, n=8, **kw):
        super().__init__(**kw)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = np.full((4, 1), i, "float32")
        return x, x


def _tapped_model(seed=None):
    """A model that records, in order, the batch (its value) each training step ran on (its
    initial weights drawn from `seed` where given)."""
    seen = []

    class Tap(keras.layers.Layer):
        def call(self, t, training=None):
            if training:
                jax.debug.callback(lambda v: seen.append(int(v)), t[0, 0], ordered=True)
            return t

    keras.backend.clear_session()
    if seed is not None:
        keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((1,)), Tap(), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model, seen


@pytest.mark.parametrize("workers", [1, 3])
def test_resumable_dataset_with_worker_threads_trains_each_epoch_in_its_own_order(ckdir, workers):
    """Keras' own prefetching (workers > 1) serves batches fetched ahead at the start of the next
    epoch; the wrapper fetches on the dataset's threads itself, within the epoch's order."""
    ds = ResumableDataset(_Indexed(workers=workers, max_queue_size=3), shuffle_seed=0)
    assert ds.workers == 1
    model, seen = _tapped_model()
    model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[AsyncCheckpoint(ckdir, save_freq=3, data=ds)])
    jax.effects_barrier()
    assert seen == [int(i) for e in range(3) for i in ds.batch_order(e)]
    with pytest.raises(cc.ConfigError, match="use_multiprocessing"):
        ResumableDataset(_Indexed(workers=2, use_multiprocessing=True))


def test_a_resumable_dataset_read_out_of_order_is_warned_about(caplog):
    ds = ResumableDataset(_Indexed(n=8), shuffle_seed=0)
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        [ds[i] for i in range(8)]
        ds.on_epoch_end()
        assert not caplog.records
        [ds[i] for i in (3, 1, 0, 2)]   # as fit(shuffle=True) asks
    assert len(caplog.records) == 1 and "out of order" in caplog.records[0].getMessage()


def test_a_resumable_dataset_epoch_must_be_one_pass(ckdir):
    ds = ResumableDataset(_Indexed(n=16), shuffle_seed=0)
    model, _ = _tapped_model()
    with pytest.raises(cc.ConfigError, match="6 steps per epoch, but the ResumableDataset holds 16"):
        model.fit(ds, epochs=2, steps_per_epoch=6, shuffle=False, verbose=0,
                  callbacks=[AsyncCheckpoint(ckdir, data=ds)])
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == []


class _Crash(Exception):
    pass


@pytest.mark.parametrize("spe, save_freq, crash_at", [(1, 5, 7), (3, 6, 9)])
def test_a_resumed_epoch_ends_with_its_epoch_end_save(ckdir, spe, save_freq, crash_at):
    """Resumed after a mid-epoch save, the epoch is shortened, but Keras counts its calls from the
    full length: the call that finds no data left must not count or save (it took the epoch-end
    save's step, without metrics; with steps_per_execution it saved a batch beyond the epoch)."""
    ds = ResumableDataset(_Indexed(n=10), shuffle_seed=0)
    model, _ = _tapped_model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=spe)
    cb = AsyncCheckpoint(ckdir, save_freq=save_freq, data=ds)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == crash_at:
                raise _Crash()

    with pytest.raises(_Crash):
        model.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[cb, Crash()])
    cb.wait_until_finished()
    assert cb.manager.all_steps() == [save_freq]
    model.fit(ds, epochs=2, shuffle=False, verbose=0, callbacks=[cb])   # resumes after batch save_freq
    assert cb.resumed_step == save_freq and int(model.optimizer.iterations) == 20
    mngr = cc.CheckpointManager(ckdir, read_only=True)
    ends = [s for s in mngr.all_steps() if int(mngr.restore(s)["progress"]["batch"]) == 0]
    assert ends == [10, 20] and all("loss" in mngr.metrics(s) for s in ends)
    assert int(mngr.restore(20)["progress"]["global_step"]) == 20


def test_a_mid_epoch_step_is_not_resumed_without_data_and_a_dataset_fit_does_not_read_is_refused(ckdir):
    """A callback without data= resumed a mid-epoch step saying "after batch 3" while fit() ran
    that epoch's first batches again (the step numbers then drifted from optimizer.iterations);
    a ResumableDataset given as data= but not to fit() did the same."""
    ds = ResumableDataset(_Indexed(n=8), shuffle_seed=0)
    model, _ = _tapped_model()
    cb = AsyncCheckpoint(ckdir, save_freq=3, data=ds)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 5:
                raise _Crash()

    with pytest.raises(_Crash):
        model.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[cb, Crash()])
    cb.wait_until_finished()
    assert cb.manager.all_steps() == [3]
    x = np.full((32, 1), 1.0, "float32")
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(cc.ConfigError, match=r"step 3 .* inside epoch 1, after batch 3 .* no data=.*nothing was "
                                             r"restored"):
        model.fit(x, x, batch_size=4, epochs=2, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
    assert all((a == b).all() for a, b in zip(before, model.get_weights()))
    # data= a ResumableDataset that fit() does not read: refused once a step has run, before a save
    other = AsyncCheckpoint(ckdir, save_freq=3, data=ResumableDataset(_Indexed(n=8), shuffle_seed=0))
    with pytest.raises(cc.ConfigError, match="does not read from"):
        model.fit(x, x, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[other])
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [3]
    # the same wrapper read by fit(): resumes (after batch 3) and trains on
    model.fit(ds, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 3 and int(model.optimizer.iterations) == 16


@pytest.mark.parametrize("batches", [8, 4, 2])
def test_a_mid_epoch_resume_into_epochs_of_another_length_is_warned_about(ckdir, caplog, batches):
    """Saved after batch 2 of an 8-batch epoch, resumed over a dataset of 4 larger batches (another
    batch size): batch 2 is another place in the data, and the resume said nothing. Over 2 batches
    the resumed epoch has none left: Keras failed on it (UnboundLocalError: an epoch that ran no
    step); it resumes at the next epoch's start."""
    ds = ResumableDataset(_Indexed(n=8), shuffle_seed=0)
    model, _ = _tapped_model()
    cb = AsyncCheckpoint(ckdir, save_freq=5, data=ds)
    model.fit(ds, epochs=2, shuffle=False, verbose=0, callbacks=[_StopAfter(10), cb])
    assert cb.manager.all_steps() == [5, 8, 10]   # step 10: after batch 2 of epoch 2
    ds = ResumableDataset(_Indexed(n=batches), shuffle_seed=0)
    model, _ = _tapped_model()
    cb = AsyncCheckpoint(ckdir, save_freq=5, data=ds)
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        model.fit(ds, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 10 and (cb.initial_epoch, cb.initial_batch) == ((1, 2) if batches > 2 else (2, 0))
    warned = f"step 10 was saved after batch 2 of epoch 2, whose epochs had 8 batches; this fit's have {batches}"
    assert (warned in caplog.text) == (batches != 8), caplog.text


class _StopAfter(keras.callbacks.Callback):
    """Sets `stop_training` after the n-th batch of the fit (a time budget)."""

    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            self.model.stop_training = True


def test_a_fit_stopped_inside_an_epoch_is_not_saved_as_an_ended_epoch(tmp_path, caplog):
    """`stop_training` set after batch 5 of epoch 2: the epoch-end save recorded epoch 2 as ended, so
    the resumed fit() skipped its last 3 batches (21 steps instead of 24, other weights). Without a
    position to continue from, that epoch is not saved; with a ResumableDataset it is saved where it
    stopped and the resumed fit() continues at the next batch."""
    x, y, _ = _data()
    whole = _model()
    whole.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    model = _model()
    cb = AsyncCheckpoint(tmp_path / "arrays")
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[_StopAfter(13), cb])
    assert cb.manager.all_steps() == [8] and "stopped after batch 5 of epoch 2's 8; not saving" in caplog.text
    model = _model()
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 8 and cb.manager.all_steps() == [8, 16, 24]
    for path, (value, _) in _state(whole).items():
        np.testing.assert_array_equal(_state(model)[path][0], value, err_msg=path)

    orders = []
    for stop in (None, 13):
        model, seen = _tapped_model()
        ds = ResumableDataset(_Indexed(n=8), shuffle_seed=0)
        cb = AsyncCheckpoint(tmp_path / f"resumable{stop}", data=ds)
        if stop:
            model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[_StopAfter(stop), cb])
            assert cb.manager.all_steps() == [8, 13]
            progress = cb.manager.restore(13)["progress"]
            assert (int(progress["epoch"]), int(progress["batch"])) == (1, 5)
        model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
        jax.effects_barrier()
        assert int(model.optimizer.iterations) == 24
        orders.append(list(seen))
    assert orders[0] == orders[1] and len(orders[0]) == 24


class _ListIterator:
    """A finite iterator with Grain's get_state()/set_state() protocol."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def __next__(self):
        if self.i >= len(self.items):
            raise StopIteration
        self.i += 1
        return self.items[self.i - 1]

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def test_an_epoch_of_unknown_length_ends_with_its_epoch_end_save(ckdir):
    """Without steps_per_epoch, Keras begins one more call after the last batch before it finds
    the data ended: a mid-epoch save due then took the step, and the epoch-end save (with its
    metrics and the next epoch's position) was skipped as a duplicate; it now replaces it."""
    x = np.full((4, 1), 1.0, "float32")
    it = _ListIterator([(x, x)] * 8)
    model, _ = _tapped_model()
    cb = AsyncCheckpoint(ckdir, save_freq=4, data=it)
    model.fit(cb.batches(), epochs=1, verbose=0, callbacks=[cb])
    assert int(model.optimizer.iterations) == 8 and cb.manager.all_steps() == [4, 8]
    mngr = cc.CheckpointManager(ckdir, read_only=True)
    progress = mngr.restore(8)["progress"]
    assert (int(progress["epoch"]), int(progress["batch"])) == (1, 0) and "loss" in mngr.metrics(8)


def test_a_wrapper_left_inside_a_resumed_epoch_is_reset_not_trained_short(ckdir):
    ds = ResumableDataset(_Indexed(n=10), shuffle_seed=0)
    ds.set_position(0, 3)   # as a fit() that raised inside a resumed epoch leaves it
    model, _ = _tapped_model()
    cb = AsyncCheckpoint(ckdir, data=ds)
    with pytest.raises(cc.ConfigError, match="call fit\\(\\) again"):
        model.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    model.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    assert int(model.optimizer.iterations) == 10 and cb.manager.all_steps() == [10]


def test_steps_count_only_batches_run_when_steps_per_execution_overshoots_the_epoch(ckdir):
    """10 batches per epoch in calls of 3: Keras reports the last call as steps 9-11."""
    x, y, _ = _data(n=160)
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=3)
    cb = AsyncCheckpoint(ckdir)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    assert int(model.optimizer.iterations) == 20 and cb.manager.all_steps() == [10, 20]
    assert int(cc.CheckpointManager(ckdir, read_only=True).restore(20)["progress"]["global_step"]) == 20


def _classifier():
    """A two-class model compiled with an accuracy metric, its data and labels:
    (model, x, labels, (val x, val y), val labels)."""
    x, y, val = _data()
    keras.backend.clear_session()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model, x, (y[:, 0] > 0).astype("int32"), val, (val[1][:, 0] > 0).astype("int32")


def test_a_retention_dict_keep_best_without_mode_follows_the_metric_direction(ckdir):
    model, x, labels, val, vlabels = _classifier()
    for metric, mode in [("val_accuracy", "max"), ("val_loss", "min")]:
        cb = AsyncCheckpoint(os.path.join(ckdir, metric), monitor="val_accuracy",
                             retention={"keep_last": 1, "keep_best": {"metric": metric}})
        model.fit(x, labels, batch_size=16, epochs=1, validation_data=(val[0], vlabels), verbose=0, callbacks=[cb])
        assert [(p.metric, p.mode) for p in cb.manager.policies if isinstance(p, cc.KeepBest)] == [(metric, mode)]
    cb = AsyncCheckpoint(os.path.join(ckdir, "x"), retention={"keep_best": {"metric": "val_mystery"}})
    with pytest.raises(cc.ConfigError, match="retention.keep_best: cannot tell whether 'val_mystery'"):
        model.fit(x, labels, batch_size=16, epochs=1, verbose=0, callbacks=[cb])


def test_configuration_errors(ckdir):
    with pytest.raises(cc.ConfigError, match="ResumableDataset"):
        AsyncCheckpoint(ckdir, save_freq=10)
    with pytest.raises(cc.ConfigError, match="save_freq"):
        AsyncCheckpoint(ckdir, save_freq="batch")
    for bad in (0, 2.0, True, np.array([5]), np.float64(5)):
        with pytest.raises(cc.ConfigError, match="save_freq must be"):
            AsyncCheckpoint(ckdir, save_freq=bad, data=False)
    cb = AsyncCheckpoint(ckdir, save_freq=np.int64(5), data=False)   # refused as "not a positive int" before
    assert cb.save_freq == 5 and type(cb.save_freq) is int
    with pytest.raises(cc.ConfigError, match="keep_last"):
        AsyncCheckpoint(ckdir, keep_last=0)
    with pytest.raises(cc.ConfigError, match="async_save"):
        AsyncCheckpoint(ckdir, async_save=0)
    bad = [({"initial_value_threshold": "0.5"}, "initial_value_threshold"),
           ({"initial_value_threshold": float("nan")}, "initial_value_threshold"),
           ({"resume": "no"}, "resume"), ({"fallback": 1}, "fallback"), ({"monitor": None}, "monitor"),
           ({"max_staging_bytes": "64MB"}, "max_staging_bytes"), ({"verbose": "yes"}, "verbose"),
           ({"verbose": 5}, "verbose must be 0 .* or 1"), ({"timeout_s": 0}, "timeout_s"),
           ({"timeout_s": "60"}, "timeout_s"), ({"data_remap": [0]}, "data_remap must be a dict"),
           ({"data_remap": {0: 0}}, "data_remap maps saved positions of a data= iterator")]
    for kwargs, match in bad:   # at construction, not in the middle of fit()
        with pytest.raises(cc.ConfigError, match=match):
            AsyncCheckpoint(ckdir, **kwargs)
    for directory in (None, "", 3):
        with pytest.raises(cc.ConfigError, match="directory"):
            AsyncCheckpoint(directory)
    x, y, _ = _data()
    _model().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
    with pytest.raises(cc.ConfigError, match="resume=False"):
        _model().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncCheckpoint(ckdir, resume=False)])


def test_resume_false_refuses_another_runs_directory_but_its_own_next_fit_continues(ckdir):
    """resume=False refuses checkpoints from before the callback's first fit, not its own: a second
    fit() with the same model and callback continued the run (it raised ConfigError "already holds
    checkpoints ... resume=False"), ending bit-equal to one fit() of all the epochs."""
    x, y, val = _data()
    ref = _model()
    ref.fit(x, y, batch_size=16, epochs=4, validation_data=val, verbose=0)
    model = _model()
    cb = AsyncCheckpoint(ckdir, resume=False)
    model.fit(x, y, batch_size=16, epochs=2, validation_data=val, verbose=0, callbacks=[cb])
    model.fit(x, y, batch_size=16, epochs=4, validation_data=val, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 8 and cb.initial_epoch == 2 and cb.manager.all_steps() == [4, 8, 12, 16]
    assert int(model.optimizer.iterations.numpy()) == 16
    got, want = _state(model), _state(ref)
    assert got.keys() == want.keys() and all(got[k][0].tobytes() == want[k][0].tobytes() for k in want)
    with pytest.raises(cc.ConfigError, match="resume=False"):   # another callback: another run
        _model().fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[AsyncCheckpoint(ckdir, resume=False)])
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [4, 8, 12, 16]


def test_a_resumed_fit_that_raises_leaves_no_first_epoch_for_the_next_fit(ckdir):
    """A resumed fit() that another callback (or Ctrl-C) stops gets no on_train_end: the
    model._initial_epoch the resume set stayed on the model, and the next fit() without the
    callback started there (fit(epochs=2) after a resume at epoch 2 trained nothing, silently)."""
    x, y, _ = _data()
    model = _model()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            raise KeyboardInterrupt

    cb = AsyncCheckpoint(ckdir)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[cb, Interrupt()])
    assert cb.resumed_step == 8 and cb.initial_epoch == 2
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)   # no checkpointing: epochs 1 and 2
    assert len(history.history["loss"]) == 2 and int(model.optimizer.iterations.numpy()) == 16
    cb.manager.close()


def test_other_backends_are_refused(tmp_path):
    code = ("import ckpt_callbacks as cc\nfrom ckpt_callbacks.keras import AsyncCheckpoint\n"
            "try:\n    AsyncCheckpoint('x')\nexcept cc.ConfigError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**ENV, "KERAS_BACKEND": "numpy"}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert "refused: AsyncCheckpoint needs the JAX backend" in out.stdout and "'numpy'" in out.stdout, out.stderr


def test_background_write_failure_is_raised_by_fit_at_train_end(ckdir):
    """Keras swallows nothing of ours: the failed last save surfaces from model.fit itself."""
    from ckpt_callbacks import localstore

    class Failing(localstore.LocalStore):
        def write(self, rel, data, sync=True):
            raise OSError(28, "No space left on device (injected)")

    class Inject(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            cb.manager.store = Failing(cb.manager.store.root)

    model = _model()
    x, y, val = _data()
    cb = AsyncCheckpoint(ckdir)
    with pytest.raises(cc.CheckpointSaveError, match="injected"):
        model.fit(x, y, validation_data=val, epochs=1, batch_size=16, verbose=0, callbacks=[cb, Inject()])
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == []


class _Boom(keras.callbacks.Callback):
    """Interrupts fit() (as a crash would) at batch `batch` of epoch `epoch`."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("interrupted")


def _grain_iterator(x, y):
    import grain
    return iter(grain.MapDataset.range(len(x)).shuffle(seed=0).repeat(None).batch(16).map(lambda i: (x[i], y[i])))


class _IteratorBatches(keras.utils.PyDataset):
    """A PyDataset that reads a get_state/set_state iterator (ignoring the index)."""

    def __init__(self, it, n):
        super().__init__()
        self.it, self.n = it, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return next(self.it)


def _weights(model):
    return [np.asarray(v.value) for v in model.trainable_variables + model.optimizer.variables]


def _assert_same_weights(a, b):
    for u, v in zip(_weights(a), _weights(b)):
        np.testing.assert_array_equal(u, v)


class _LiveStateIterator:
    """A get_state()/set_state() iterator whose get_state() returns its live state dict."""

    def __init__(self, items, live):
        self.items, self.state, self.live = items, {"i": 0}, live

    def __next__(self):
        self.state["i"] += 1
        return self.items[(self.state["i"] - 1) % len(self.items)]

    def get_state(self):
        return self.state if self.live else dict(self.state)

    def set_state(self, state):
        self.state["i"] = state["i"]


def test_an_iterator_handing_out_its_live_state_is_set_back_to_the_last_save(tmp_path):
    """The epoch-end save is skipped (a NaN loss), so the next fit() must set the iterator back to
    the last saved step's position. An iterator whose get_state() returns its live dict made the
    kept state always equal the iterator's, and the next fit() trained on from where it stood,
    past the batches after step 3 (other data, other weights than with a copied state)."""
    x, y, _ = _data(n=96)
    items = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)]
    items[4] = (np.full_like(items[4][0], np.nan), items[4][1])   # the batch of step 4
    weights = {}
    for live in (False, True):
        it = _LiveStateIterator(items, live)
        model, cb = _model(), AsyncCheckpoint(str(tmp_path / str(live)), save_freq=3, data=it)
        model.fit(_IteratorBatches(it, 4), epochs=1, steps_per_epoch=4, verbose=0, callbacks=[cb])
        assert cb.manager.all_steps() == [3], live   # step 4's save skipped: its loss is NaN
        model.fit(_IteratorBatches(it, 4), epochs=3, verbose=0, callbacks=[cb])
        assert cb.resumed_step == 3 and cb.manager.all_steps() == [3], live
        weights[live] = _weights(model)
    for a, b in zip(weights[False], weights[True]):
        np.testing.assert_array_equal(a, b)


def test_a_grain_iterator_resumes_exactly_through_batches_or_a_pydataset(tmp_path):
    """Keras reads a generator's first two batches before any callback runs and trains on them;
    `cb.batches()` puts the iterator at the checkpoint's position on its first read. A PyDataset
    over the iterator has one batch read to build the model and not trained on, which
    on_train_begin undoes. Each run below is interrupted in epoch 3 and resumed as a new process
    would (a new model, iterator and callback), or by fit() again with the same callback."""
    x, y, _ = _data(n=96)
    kw = dict(steps_per_epoch=4, epochs=4, verbose=0)

    def reference(feed):                     # 4 epochs, uninterrupted
        it = _grain_iterator(x, y)
        model, cb = _model(), AsyncCheckpoint(str(tmp_path / f"ref-{len(refs)}"), data=it)
        model.fit(feed(cb, it), callbacks=[cb], **kw)
        return model

    def interrupted(d, feed):
        it = _grain_iterator(x, y)
        cb = AsyncCheckpoint(d, data=it)
        model = _model()
        with pytest.raises(KeyboardInterrupt):
            model.fit(feed(cb, it), callbacks=[cb, _Boom(2, 1)], **kw)
        return model, cb, it

    generator = lambda cb, it: cb.batches()                                   # noqa: E731
    pydataset = lambda cb, it: _IteratorBatches(it, kw["steps_per_epoch"])    # noqa: E731
    refs = []
    for name, feed in (("gen", generator), ("pyds", pydataset)):
        ref = reference(feed)
        refs.append(ref)
        d = str(tmp_path / name)
        old = interrupted(d, feed)[1]
        old.manager.close()                  # as the interrupted process's exit would
        it = _grain_iterator(x, y)           # a new process
        model, cb = _model(), AsyncCheckpoint(d, data=it)
        model.fit(feed(cb, it), callbacks=[cb], **kw)
        assert cb.resumed_step == 8, name
        _assert_same_weights(model, ref)

        d = str(tmp_path / (name + "-again"))   # fit() again in the same process, same callback
        model, cb, it = interrupted(d, feed)
        model.fit(feed(cb, it), callbacks=[cb], **kw)
        assert cb.resumed_step == 8, name
        _assert_same_weights(model, ref)

    d = str(tmp_path / "twice")              # two fits of one callback, one generator: 2 epochs, then 4
    it = _grain_iterator(x, y)
    model, cb = _model(), AsyncCheckpoint(d, data=it)
    batches = cb.batches()
    model.fit(batches, callbacks=[cb], **{**kw, "epochs": 2})
    model.fit(batches, callbacks=[cb], **kw)
    assert cb.resumed_step == 8
    _assert_same_weights(model, refs[0])
    with pytest.raises(cc.ConfigError, match="batches"):
        next(AsyncCheckpoint(d).batches())

    # the generator of a fit() that raised, given to the next fit(): Keras reads from it at a
    # position past the last save before any hook runs; refused before anything is loaded
    it = _grain_iterator(x, y)
    model, cb = _model(), AsyncCheckpoint(str(tmp_path / "reused"), data=it)
    batches = cb.batches()
    with pytest.raises(KeyboardInterrupt):
        model.fit(batches, callbacks=[cb, _Boom(2, 1)], **kw)
    before = _weights(model)
    with pytest.raises(cc.ConfigError, match="pass a new cb.batches"):
        model.fit(batches, callbacks=[cb], **kw)
    for a, b in zip(_weights(model), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("how", ["keep_best", "retention dict", "retention policy"])
def test_a_ranked_metric_missing_from_the_logs_is_warned_about_once(ckdir, caplog, how):
    x, y, val = _data()
    kw = {"keep_best": {"monitor": "val_acc", "mode": "max", "keep_best": 1},   # a typo: no "val_acc"
          "retention dict": {"retention": {"keep_best": {"metric": "val_acc", "mode": "max"}}},
          "retention policy": {"retention": cc.KeepBest("val_acc", "max")}}[how]
    cb = AsyncCheckpoint(ckdir, **kw)
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        _model().fit(x, y, batch_size=16, epochs=3, validation_data=val, verbose=0, callbacks=[cb])
    warned = [r.getMessage() for r in caplog.records if "do not have it" in r.getMessage()]
    assert len(warned) == 1 and "'val_acc'" in warned[0] and "val_mae" in warned[0], warned
    assert cb.manager.best_step() is None
    caplog.clear()
    with caplog.at_level("WARNING", "ckpt_callbacks"):   # without keep_best nothing ranks: no warning
        _model().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncCheckpoint(ckdir + "2")])
    assert not [r for r in caplog.records if "do not have it" in r.getMessage()]


def test_a_ranked_metric_logged_as_an_array_is_told_as_such_and_one_of_one_value_ranks(tmp_path, caplog):
    """F1Score logs one value per class: no step can rank by it. The only warning said the logs
    did not have 'val_f1_score' ("check the metric's name"); an F1Score of one class (shape (1,))
    never ranked either."""
    x, y, val = _data()
    yc = np.concatenate([y > 0, y < 0], axis=1).astype("float32")
    for classes, kw in ((2, {}), (1, {"keep_last": 1})):
        keras.backend.clear_session()
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(classes, activation="sigmoid")])
        model.compile("adam", "binary_crossentropy", metrics=[keras.metrics.F1Score()])
        cb = AsyncCheckpoint(str(tmp_path / str(classes)), monitor="val_f1_score", keep_best=1, **kw)
        caplog.clear()
        with caplog.at_level("WARNING", "ckpt_callbacks"):
            model.fit(x, yc[:, :classes], batch_size=16, epochs=3, verbose=0, callbacks=[cb],
                      validation_data=(val[0], np.concatenate([val[1] > 0, val[1] < 0], 1)[:, :classes]))
        said = [r.getMessage() for r in caplog.records]
        if classes == 2:
            assert cb.manager.best_step() is None and cb.best is None
            assert len([m for m in said if "f1_score" in m]) == 1, said   # once per fit, and not "lack it"
            assert "'val_f1_score' is an array of shape (2,) in epoch 1's logs" in said[0], said
        else:
            assert not said and cb.best is not None
            assert cb.manager.best_step() in cb.manager.all_steps()
            assert cb.manager.metrics(cb.manager.best_step())["val_f1_score"] == cb.best


def test_a_resume_under_another_dtype_policy_is_warned_about(ckdir, caplog):
    """keras.backend.clear_session() (as docs advise before building the model again) also resets
    the global mixed-precision policy: a mixed_bfloat16 run resumed in float32, silently (the
    variables are float32 under both, so the strict restore passed)."""
    x, y, _ = _data()
    try:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        _model(clear=False).fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
        for policy, warned in (("mixed_bfloat16", False), ("float32", True)):
            keras.backend.clear_session()   # resets the policy to float32
            keras.mixed_precision.set_global_policy(policy)
            cb = AsyncCheckpoint(ckdir)
            caplog.clear()
            with caplog.at_level("WARNING", "ckpt_callbacks"):
                _model(clear=False).fit(x, y, batch_size=16, epochs=3 if warned else 2, verbose=0, callbacks=[cb])
            said = [r.getMessage() for r in caplog.records if "dtype policies" in r.getMessage()]
            assert cb.resumed_step is not None
            if warned:
                assert len(said) == 1 and "dtype policies mixed_bfloat16, and this one has float32:" in said[0], said
            else:
                assert not said
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_resume_ranking_by_another_monitor_does_not_start_from_the_old_monitors_best(ckdir):
    """cb.best (and the verbose 'improved' lines) continued from the saved best of the run's old
    monitor: val_loss's best (mse of flipped targets, large), which no val_mae beat, stayed."""
    x, y, val = _data(flip_val=True)
    first = AsyncCheckpoint(ckdir, monitor="val_loss", mode="max")
    _model().fit(x, y, batch_size=16, epochs=2, validation_data=val, verbose=0, callbacks=[first])
    history = []
    for mode, epochs in (("max", 4), ("max", 5), ("min", 6)):
        cb = AsyncCheckpoint(ckdir, monitor="val_mae", mode=mode)
        h = _model().fit(x, y, batch_size=16, epochs=epochs, validation_data=val, verbose=0, callbacks=[cb])
        history += h.history["val_mae"]
        if epochs == 4:    # another monitor: its best is of this fit's epochs alone
            assert max(history) < first.best and cb.best == pytest.approx(max(history))
        if epochs == 5:    # the same monitor and mode: the best goes on from the saved one
            assert cb.best == pytest.approx(max(history))
        if epochs == 6:    # the same monitor, the other direction
            assert cb.best == pytest.approx(min(h.history["val_mae"]))


def test_a_keep_best_without_a_mode_for_an_unknown_metric_lists_the_known_ones(ckdir):
    x, y, val = _data()
    cb = AsyncCheckpoint(ckdir, retention={"keep_best": {"metric": "val_acuracy"}})
    with pytest.raises(cc.ConfigError, match=r"'val_acuracy'.*compiled metrics \(.*mae.*spelling"):
        _model().fit(x, y, batch_size=16, epochs=1, validation_data=val, verbose=0, callbacks=[cb])


def test_resuming_a_finished_run_says_there_is_nothing_left_to_train(ckdir, caplog):
    x, y, _ = _data()
    _model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        hist = _model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[AsyncCheckpoint(ckdir)])
    assert hist.epoch == []
    assert any("nothing left to train" in r.getMessage() for r in caplog.records)


def test_a_damaged_latest_step_stops_fit_unless_fallback_resumes_from_the_newest_intact_one(ckdir, caplog):
    x, y, _ = _data()
    reference = _model()
    reference.fit(x, y, batch_size=16, epochs=4, verbose=0)
    _model().fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[AsyncCheckpoint(ckdir, keep_last=3)])
    blob = os.path.join(ckdir, "step_0000000012", "blobs", "p0-0.msgpack")   # epoch 3's save
    data = bytearray(open(blob, "rb").read())
    data[-3] ^= 0xFF
    open(blob, "wb").write(bytes(data))

    model = _model()
    model.build((None, 8))
    before = [np.asarray(v.value).copy() for v in model.trainable_variables]
    with pytest.raises(cc.CorruptCheckpointError, match=r"step 12 in .* is damaged(.|\n)*AsyncCheckpoint\(\.\.\., fallback=True\)"):
        model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[AsyncCheckpoint(ckdir, keep_last=3)])
    assert all(np.array_equal(b, np.asarray(v.value)) for b, v in zip(before, model.trainable_variables))

    cb = AsyncCheckpoint(ckdir, keep_last=3, fallback=True)
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        hist = _model().fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[cb])
    assert any("step 12" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert cb.resumed_step == 8 and hist.epoch == [2, 3]   # epoch 3 trained again, then epoch 4
    mngr = cc.CheckpointManager(ckdir, read_only=True)
    assert mngr.all_steps() == [8, 12, 16]
    mngr.restore(12)   # saved anew, over the damaged one
    _assert_same_weights(cb.model, reference)
    with pytest.raises(cc.ConfigError, match="fallback must be True or False"):
        AsyncCheckpoint(ckdir, fallback="yes")


@pytest.mark.parametrize("damage", ["blob", "host"])
def test_fallback_positions_a_batches_generator_at_the_step_it_restores(tmp_path, damage, caplog):
    """`cb.batches()` positions the iterator before `fit` (Keras reads two batches before any
    callback): with fallback it takes the position of the step that on_train_begin will restore."""
    x, y, _ = _data(n=96)
    d = str(tmp_path / "run")
    kw = dict(steps_per_epoch=4, verbose=0)
    reference, cb = _model(), AsyncCheckpoint(str(tmp_path / "ref"), data=_grain_iterator(x, y))
    reference.fit(cb.batches(), callbacks=[cb], epochs=4, **kw)   # uninterrupted
    it = _grain_iterator(x, y)
    cb = AsyncCheckpoint(d, data=it)
    _model().fit(cb.batches(), callbacks=[cb], epochs=3, **kw)
    path = os.path.join(d, "step_0000000012", "blobs" if damage == "blob" else "host",
                        "p0-0.msgpack" if damage == "blob" else "p0.msgpack")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF
    open(path, "wb").write(bytes(data))
    cb = AsyncCheckpoint(d, data=_grain_iterator(x, y))
    with pytest.raises(cc.CorruptCheckpointError, match=r"step 12 .*damaged(.|\n)*fallback=True"):
        _model().fit(cb.batches(), callbacks=[cb], epochs=4, **kw)
    cb = AsyncCheckpoint(d, data=_grain_iterator(x, y), fallback=True)
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        hist = _model().fit(cb.batches(), callbacks=[cb], epochs=4, **kw)
    assert cb.resumed_step == 8 and hist.epoch == [2, 3]
    _assert_same_weights(cb.model, reference)   # epochs 3 and 4 saw the batches they should
    assert cc.CheckpointManager(d, read_only=True).all_steps() == [4, 8, 12, 16]



def test_verbose_lines_start_lines_of_their_own_beside_keras_progress_bar(ckdir, capsys):
    """Keras' progress bar has not ended its line when epoch-end callbacks run: our lines were
    glued onto it ("... loss: 0.6650AsyncCheckpoint: saving step 182")."""
    x, y, val = _data()
    _model().fit(x, y, batch_size=16, epochs=2, verbose=1, validation_data=val,
                 callbacks=[AsyncCheckpoint(ckdir, monitor="val_loss", verbose=1)])
    lines = capsys.readouterr().out.splitlines()
    ours = [ln for ln in lines if "AsyncCheckpoint:" in ln]
    assert len([ln for ln in ours if "saving step" in ln]) == 2
    assert all(ln.startswith("AsyncCheckpoint:") for ln in ours), ours


def test_a_misspelt_monitor_is_told_with_the_models_metric_names_and_verbose_says_improved_like_keras(
        ckdir, capsys):
    """mode='auto' with a monitor it cannot place advised only mode='min'/'max' (which keeps the
    typo); the verbose line said "improved from None to 0.7170161008834839"."""
    model, x, labels, val, vlabels = _classifier()
    cb = AsyncCheckpoint(os.path.join(ckdir, "typo"), monitor="val_acuracy", keep_best=1)
    with pytest.raises(cc.ConfigError, match=r"spelling.*|accuracy") as e:
        model.fit(x, labels, batch_size=16, epochs=1, validation_data=(val[0], vlabels), verbose=0, callbacks=[cb])
    assert "val_acuracy" in str(e.value) and "accuracy" in str(e.value).split("val_acuracy", 1)[1]
    assert "spelling" in str(e.value)
    cb = AsyncCheckpoint(os.path.join(ckdir, "ok"), monitor="val_loss", keep_best=1, verbose=1)
    model.fit(x, labels, batch_size=16, epochs=1, validation_data=(val[0], vlabels), verbose=0, callbacks=[cb])
    out = capsys.readouterr().out
    assert re.search(r"AsyncCheckpoint: val_loss improved from inf to \d+\.\d{5}\n", out), out


# -- preemption -----------------------------------------------------------------------------------
class _Notice(keras.callbacks.Callback):
    """Sends this process SIGTERM (a preemption notice) in the n-th batch of the fit, from its
    batch-begin hook (Keras then still runs AsyncCheckpoint's batch-end hook on a thread of its own)
    or from its batch-end hook (which makes Keras call every batch-end hook in line, on fit's thread)."""

    def __init__(self, n, hook="begin"):
        super().__init__()
        self.n, self.seen = n, 0
        setattr(self, f"on_train_batch_{hook}", self._tick)

    def _tick(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _sigterm_recorded():
    """SIGTERM handled by a recorder meanwhile: yields (the recorder, the signals it got). (It
    replaces whatever an earlier test's fit() that raised left installed.)"""
    got = []
    handler = lambda s, f: got.append(s)   # noqa: E731
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler, got
    finally:
        signal.signal(signal.SIGTERM, old)


def _preemption_fit(d, callbacks=(), epochs=3, **kw):
    """A tapped model on a ResumableDataset of 8 batches an epoch: (model, seen, callback)."""
    model, seen = _tapped_model(seed=0)
    ds = ResumableDataset(_Indexed(n=8), shuffle_seed=0)
    cb = AsyncCheckpoint(d, data=ds, **kw)
    model.fit(ds, epochs=epochs, shuffle=False, verbose=0, callbacks=[c if c != "cb" else cb for c in callbacks])
    jax.effects_barrier()
    return model, list(seen), cb


@pytest.mark.parametrize("hook", ["begin", "end"])
def test_sigterm_mid_epoch_saves_the_step_reached_stops_fit_and_the_rerun_resumes_exactly(tmp_path, caplog, hook):
    """SIGTERM in the 11th batch (epoch 2, batch 3): step 11 is saved off the schedule (epoch ends
    only), committed, and fit() stops; the handler from before fit() is back. Where Keras runs the
    callback's batch-end hook on its own thread (`begin`), the save is taken before the 12th batch,
    which Keras still runs (it checks stop_training after a batch); where Keras calls it in line
    (`end`), right after the 11th. The same fit() run again continues at batch 4 of epoch 2 and ends
    with the weights and batch order of a run never interrupted."""
    ref_model, ref_seen, _ = _preemption_fit(str(tmp_path / "ref"), ["cb"])
    d = str(tmp_path / "run")
    notice = _Notice(11, hook)
    order = ["cb", notice] if hook == "begin" else [notice, "cb"]   # (begin: after the boundary it asks at)
    with caplog.at_level("WARNING", "ckpt_callbacks"), _sigterm_recorded() as (before, got):
        model, seen, cb = _preemption_fit(d, order)
        assert signal.getsignal(signal.SIGTERM) == before and got == []   # not passed on: fit() handled it
    assert cb.preempted and cb.preempted_step == 11 and cb.manager.all_steps() == [8, 11]
    assert "preempted (SIGTERM): step 11 is committed" in caplog.text and "fit() stops" in caplog.text
    ran = 12 if hook == "begin" else 11
    assert int(model.optimizer.iterations) == ran and len(model.history.epoch) == 2
    progress = cc.CheckpointManager(d, read_only=True).restore(11)["progress"]
    assert (int(progress["epoch"]), int(progress["batch"]), int(progress["global_step"])) == (1, 3, 11)
    model, rest, cb = _preemption_fit(d, ["cb"])
    assert cb.resumed_step == 11 and not cb.preempted and cb.manager.all_steps() == [8, 11, 16, 24]
    assert seen[:11] + rest == ref_seen
    _assert_same_weights(model, ref_model)


def test_sigterm_with_on_preemption_raise_raises_preempted_after_the_commit(tmp_path):
    """on_preemption="raise": the boundary after the signalled batch raises Preempted once step 11
    is committed; no batch runs after it, the handler is back and the directory is free (Keras calls
    no on_train_end after a raise). The same callback's next fit() resumes from step 11."""
    ref_model, _, _ = _preemption_fit(str(tmp_path / "ref"), ["cb"])
    from ckpt_callbacks.keras import Preempted
    from ckpt_callbacks import preemption
    assert Preempted is preemption.Preempted and issubclass(Preempted, cc.CheckpointError)
    d = str(tmp_path / "run")
    model, seen = _tapped_model(seed=0)
    ds = ResumableDataset(_Indexed(n=8), shuffle_seed=0)
    cb = AsyncCheckpoint(d, data=ds, on_preemption="raise")
    with _sigterm_recorded() as (before, got):
        with pytest.raises(Preempted, match="checkpoint committed at step 11") as e:
            model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[cb, _Notice(11)])
        assert signal.getsignal(signal.SIGTERM) == before and got == []
    assert e.value.step == 11 and cb.preempted and cb.preempted_step == 11
    assert int(model.optimizer.iterations) == 11
    with cc.CheckpointManager(d) as m:   # not locked: the callback closed its manager before raising
        assert m.all_steps() == [8, 11]
    model.fit(ds, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.resumed_step == 11 and not cb.preempted
    _assert_same_weights(model, ref_model)


def test_sigterm_at_a_scheduled_save_or_an_epoch_end_saves_once_and_without_data_saves_no_mid_epoch_step(
        tmp_path, caplog):
    """A preemption at a step that a scheduled save takes (save_freq=3: step 6; the epoch end: step
    8) saves it once; without data= a mid-epoch step is not saved (a resume could not continue at
    the next batch): fit() stops, the last epoch-end step stays the one to resume from."""
    _, _, cb = _preemption_fit(str(tmp_path / "freq"), ["cb", _Notice(6)], save_freq=3)
    assert cb.preempted_step == 6 and cb.manager.all_steps() == [3, 6] and len(cb.manager.history) == 2
    _, _, cb = _preemption_fit(str(tmp_path / "end"), ["cb", _Notice(8)])
    assert cb.preempted_step == 8 and cb.manager.all_steps() == [8] and len(cb.manager.history) == 1
    x, y, _ = _data()
    model, cb = _model(), AsyncCheckpoint(str(tmp_path / "arrays"))
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[cb, _Notice(11)])
    assert cb.preempted and cb.preempted_step == 8 and cb.manager.all_steps() == [8]
    assert "after batch 3: not saving it without data=" in caplog.text
    assert "stopped after batch" not in caplog.text   # (the partial epoch's own warning: not given twice)


def test_sigterm_is_left_alone_outside_fit_with_preemption_signals_empty_and_after_a_fit_that_raised(ckdir):
    """The handler from before fit() handles SIGTERM whenever AsyncCheckpoint does not watch it:
    with preemption_signals=() (fit() trains on), after fit(), and after a fit() that raised (Keras
    calls no on_train_end: the watch ends itself at the next signal and hands it over)."""
    with _sigterm_recorded() as (handler, got):
        _, seen, cb = _preemption_fit(ckdir, ["cb", _Notice(11)], preemption_signals=())
        assert got == [signal.SIGTERM] and not cb.preempted and len(seen) == 24
        cb = AsyncCheckpoint(ckdir + "2", data=False, on_preemption="stop")   # constructing installs nothing
        assert signal.getsignal(signal.SIGTERM) == handler
        x, y, _ = _data()

        class Crash(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                assert signal.getsignal(signal.SIGTERM) != handler   # watched inside fit()
                if batch == 2:
                    raise _Crash()

        with pytest.raises(_Crash):
            _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb, Crash()])
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGTERM] * 2 and not cb.preempted
        assert signal.getsignal(signal.SIGTERM) == handler
        # a fit() of the same model without this callback (and watching nothing) does not wake it
        other = AsyncCheckpoint(ckdir + "3", data=False, preemption_signals=())
        model = _model()
        with pytest.raises(_Crash):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb, Crash()])
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[other, _Notice(3)])
        assert got == [signal.SIGTERM] * 3 and not other.preempted


def test_preemption_options_are_checked_at_construction(ckdir):
    before = signal.getsignal(signal.SIGTERM)
    bad = [({"preemption_signals": signal.SIGTERM}, "preemption_signals must be a collection"),
           ({"preemption_signals": "SIGTERM"}, "preemption_signals must be a collection"),
           ({"preemption_signals": (signal.SIGKILL,)}, "SIGKILL and SIGSTOP cannot be caught"),
           ({"preemption_signals": (99999,)}, "not a signal a handler can catch"),
           ({"on_preemption": "flag"}, "on_preemption must be 'stop' or 'raise', got 'flag'"),
           ({"on_preemption": None}, "on_preemption must be")]
    for kwargs, match in bad:
        with pytest.raises(cc.ConfigError, match=match):
            AsyncCheckpoint(ckdir, **kwargs)
    cb = AsyncCheckpoint(ckdir, preemption_signals=[signal.SIGUSR1, signal.SIGUSR1], on_preemption="raise")
    assert cb.preemption_signals == (signal.SIGUSR1,) and signal.getsignal(signal.SIGTERM) == before
    assert not os.path.exists(ckdir)
