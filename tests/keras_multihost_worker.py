"""Keras `model.fit` with `AsyncCheckpoint` inside `jax.distributed` processes (tests/test_multihost.py).

Example (from a test, in the pytest process)::

    from multiproc import launch
    res = launch("keras_multihost_worker:fit", 2, devices_per_process=4, args={"root": str(tmp), "epochs": 2})

`fit` runs SPMD on every process: a tiny deterministic model under `keras.distribution` (a
ModelParallel whose "model" mesh axis spans the processes, so each process holds its own shards of
the sharded Dense kernel; or a DataParallel), fed through a `ResumableDataset`, and returns what
happened (JSON): the error it raised (type and message), the steps, and a digest of every
variable's global value, equal on every process and across process counts when the state is.
"""

from __future__ import annotations

import hashlib
import os
import signal

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402

BATCH, N_TRAIN, N_VAL = 16, 128, 32   # 8 batches an epoch


def _distribution(kind: str):
    import keras

    devices = jax.devices()
    if kind == "dp":
        return keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False)
    # (batch, model) with model = the process: process p holds column p of the mesh, so each writes
    # the shards of its half of "d1/kernel"; every process feeds the whole global batch
    grid = np.array(devices).reshape(jax.process_count(), -1).T
    mesh = keras.distribution.DeviceMesh(grid.shape, ("batch", "model"), devices=grid)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*d1/kernel"] = (None, "model")
    layouts[".*d1/bias"] = ("model",)
    return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch", auto_shard_dataset=False)


def _model(compile: bool = True, seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="d1"),
                              keras.layers.Dropout(0.2, name="drop"),
                              keras.layers.Dense(1, activation="sigmoid", name="out")], name="net")
    if compile:
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def _dataset():
    import keras

    from ckpt_callbacks.keras_data import ResumableDataset

    rng = np.random.default_rng(0)
    x = rng.random((N_TRAIN + N_VAL, 8)).astype("float32")
    y = (x.sum(1, keepdims=True) > 4).astype("float32")

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return N_TRAIN // BATCH

        def __getitem__(self, i):
            return x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

    return ResumableDataset(Batches(), shuffle_seed=0), (x[N_TRAIN:], y[N_TRAIN:])


class _Iterator:
    """The dataset's batches in order, endlessly, with Grain's get_state()/set_state()."""

    def __init__(self, ds, fail_at: int | None = None, pos: int = 0):
        self.ds, self.pos = ds, pos
        self.calls, self.fail_at = 0, fail_at   # get_state() raises at its `fail_at`-th call

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.ds.dataset[self.pos % len(self.ds.dataset)]
        self.pos += 1
        return batch

    def get_state(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"get_state failed at position {self.pos}")
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def _global(value) -> np.ndarray:
    """A variable's global value on every process (gathered where it spans processes)."""
    from jax.experimental import multihost_utils

    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(value)


def digest(model) -> str:
    """A hash of every variable's global value (gathered from all processes)."""
    h = hashlib.sha256()
    for v in model.variables + model.optimizer.variables:
        h.update(v.path.encode() + _global(v.value).tobytes())
    return h.hexdigest()[:16]


def load(root: str, kind: str = "mp") -> dict:
    """`load_weights` of the latest step into the run's model, built (other initial values) under
    `kind`'s distribution and not compiled: the step and each variable's global value (as lists)."""
    from ckpt_callbacks.keras import load_weights

    import keras

    keras.distribution.set_distribution(_distribution(kind))
    model = _model(compile=False, seed=1)
    step = load_weights(model, root)
    return {"step": step, "values": {v.path: _global(v.value).tolist() for v in model.variables},
            "kernel": list(model.get_layer("d1").kernel.value.sharding.spec)}


def fit(root: str, epochs: int, kind: str = "mp", save_freq=3, exit_at: int | None = None,
        exit_on_epoch_end: int | None = None, timeout_s: float | None = None, iterator: bool = False,
        fail_get_state_on_1: int | None = None, offset_iterators: bool = False, data_remap=None,
        remap_to: int | None = None, sigterm_1_at: int | None = None) -> dict:
    """`model.fit` with AsyncCheckpoint(root, save_freq, keep_last=2, keep_best=1) on every process.

    exit_at: every process leaves (``os._exit(17)``) at the begin of that batch of the run (counted
    from 1), once the save in flight has finished (a job killed between two saves);
    exit_on_epoch_end: process 1 leaves at the end of that epoch (counted from 1), before
    AsyncCheckpoint's epoch-end save, while the others go on to save;
    fail_get_state_on_1: process 1's iterator (``iterator=True``) raises at that get_state() call;
    offset_iterators: process i's iterator starts at position 100 * i;
    data_remap: AsyncCheckpoint's, a dict (JSON: str keys); remap_to: data_remap=fn taking that
    saved process's state for every process;
    sigterm_1_at: process 1 alone sends itself SIGTERM at the begin of that batch of the run
    (counted from 1), after AsyncCheckpoint's batch-begin hook.
    """
    import keras

    from ckpt_callbacks.keras import AsyncCheckpoint

    keras.distribution.set_distribution(_distribution(kind))
    model = _model()
    data, val = _dataset()
    kw = {} if timeout_s is None else {"timeout_s": timeout_s}
    if iterator:   # a get_state()/set_state() iterator over the same batches, fed through cb.batches()
        data = _Iterator(data, fail_get_state_on_1 if jax.process_index() == 1 else None,
                         100 * jax.process_index() if offset_iterators else 0)
    if data_remap is not None:
        kw["data_remap"] = {int(k): v for k, v in data_remap.items()}
    if remap_to is not None:
        kw["data_remap"] = lambda saved, i, n: saved[remap_to]
    cb = AsyncCheckpoint(root, save_freq=save_freq, data=data, keep_last=2, keep_best=1, **kw)
    fit_input = dict(x=cb.batches(), steps_per_epoch=N_TRAIN // BATCH) if iterator else dict(x=data)

    class Notice(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_begin(self, batch, logs=None):
            self.batches += 1
            if self.batches == sigterm_1_at and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    class Leave(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_begin(self, batch, logs=None):
            self.batches += 1
            if self.batches == exit_at:
                cb.wait_until_finished()
                os._exit(17)

        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 == exit_on_epoch_end and jax.process_index() == 1:
                os._exit(17)

    out: dict = {"process_index": jax.process_index(), "error_type": None}
    try:
        model.fit(**fit_input, validation_data=val, epochs=epochs, shuffle=False, verbose=0, callbacks=[Leave(), cb, Notice()])
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.update(error_type=type(e).__name__, error=str(e))
        if cb.manager is not None:   # (none where the resume failed)
            out["steps"] = cb.manager.all_steps()
        return out
    stats = cb.manager.last_stats
    out.update(steps=cb.manager.all_steps(), best=cb.manager.best_step(), resumed=cb.resumed_step,
               digest=digest(model), bytes_written=stats.bytes_written if stats else None,
               bytes_total=stats.bytes_total if stats else None,
               kernel=list(model.get_layer("d1").kernel.value.sharding.spec),
               data_pos=data.pos if iterator else None, preempted=[cb.preempted, cb.preempted_step],
               iterations=int(model.optimizer.iterations))
    if sigterm_1_at is not None:   # the per-boundary agreements' keys the coordination service still holds
        coord = cb.manager.coord
        coord.barrier("agreement-keys-counted", 60)
        out["agreement_keys"] = len(coord.client.key_value_dir_get_bytes(coord._key("keras-preemption/")))
    return out
