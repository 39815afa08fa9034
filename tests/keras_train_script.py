"""A tiny, deterministic `model.fit` run for the interruption tests of tests/test_keras.py.

Usage::

    python tests/keras_train_script.py OUT.npz [--ckpt DIR] [--data numpy|pydataset] [--save-freq epoch|N]

Runs the same training every time (fixed seeds, CPU). With --ckpt it checkpoints into DIR with
`AsyncCheckpoint` (keep_last=2 + keep_best=1 on val_loss) and, re-run unchanged after being killed,
resumes by itself. At the end it writes the final state tree (flattened, "group/path" -> array) to
OUT.npz and prints one JSON line: where it resumed and the last epoch's logs. Each batch sleeps
--sleep seconds so a test can kill it between checkpoints; the sleep does not change the numbers.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckpt_callbacks.keras import AsyncCheckpoint  # noqa: E402
from ckpt_callbacks.keras_data import ResumableDataset  # noqa: E402

BATCH, N_TRAIN, N_VAL = 8, 64, 16


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


class Sleep(keras.callbacks.Callback):
    def __init__(self, s):
        super().__init__()
        self.s = s

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ckpt")
    ap.add_argument("--data", default="numpy", choices=["numpy", "pydataset"])
    ap.add_argument("--save-freq", default="epoch")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--sleep", type=float, default=0.03)
    a = ap.parse_args()

    keras.utils.set_random_seed(1234)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N_TRAIN + N_VAL, 6)).astype("float32")
    y = (x @ rng.standard_normal((6, 1)) + 0.1 * rng.standard_normal((N_TRAIN + N_VAL, 1))).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.25), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])

    if a.data == "numpy":   # fit(shuffle=True) draws each epoch's order from numpy's global RNG
        train, kw = (x[:N_TRAIN], y[:N_TRAIN]), dict(batch_size=BATCH, shuffle=True)
        data = None if a.save_freq == "epoch" else False
    else:
        ds = ResumableDataset(Batches(x[:N_TRAIN], y[:N_TRAIN]), shuffle_seed=7)
        train, kw, data = (ds,), dict(shuffle=False), ds
    callbacks = []
    cb = None
    if a.ckpt:
        save_freq = a.save_freq if a.save_freq == "epoch" else int(a.save_freq)
        cb = AsyncCheckpoint(a.ckpt, save_freq=save_freq, keep_last=2, keep_best=1, data=data)
        callbacks.append(cb)
    callbacks.append(Sleep(a.sleep))
    hist = model.fit(*train, validation_data=(x[N_TRAIN:], y[N_TRAIN:]), epochs=a.epochs, verbose=0,
                     callbacks=callbacks, **kw)
    flat = {}
    for group, tree in model.get_state_tree(value_format="numpy_array").items():
        stack = [(group, tree)]
        while stack:
            prefix, t = stack.pop()
            for k, v in t.items():
                if isinstance(v, dict):
                    stack.append((f"{prefix}/{k}", v))
                else:
                    flat[f"{prefix}/{k}"] = np.asarray(v)
    np.savez(a.out, **flat)
    last = {k: float(v[-1]) for k, v in hist.history.items()} if hist.history.get("loss") else {}
    print(json.dumps({"resumed_step": cb.resumed_step if cb else None,
                      "initial_epoch": cb.initial_epoch if cb else 0,
                      "initial_batch": cb.initial_batch if cb else 0,
                      "epochs_run": len(hist.history.get("loss", [])),
                      "last_logs": last}), flush=True)


if __name__ == "__main__":
    main()
