"""The `fit` workload of `ckpt-callbacks bench`: Keras `model.fit` wall time with a full-state save
every epoch, per checkpoint callback, against the same fit without one.

Example::

    from ckpt_callbacks import bench_fit, bench_workloads as bw
    rows = bench_fit.run(bw.Context(root="/dev/shm/b", storage="tmpfs", scale=0.01, fit_repeats=1), bw._row)

Who calls what: `bench_workloads.run_fit` on the main thread of a bench process. Keras is imported
here, lazily, with ``KERAS_BACKEND=jax`` (a Keras already imported on another backend, or a missing
`ckpt_callbacks.keras`, turns the rows into "skipped: <reason>"). Variants: no callback,
`ckpt_callbacks.keras.AsyncCheckpoint` (keep_last=2), ``keras.callbacks.ModelCheckpoint`` (a
``.keras`` file with the optimizer, overwritten each epoch) and ``keras.callbacks.OrbaxCheckpoint``
(max_to_keep=2) where present. Each variant builds the same model, warms up (compiles) on a few
batches without a callback, then `fit` runs ``fit_epochs`` epochs into a fresh directory; the
timed span includes `on_train_end` (which waits for the last save). ``fit_repeats`` rounds (7 by
default: on this project's 2-vCPU VM a single fit varies by 10 % and more) run the variants in
turn, every other round in reverse order, so noise and drift hit them alike (and each starts
after an ``os.sync()``: Keras' ModelCheckpoint, for one, leaves its file to the kernel's
writeback, which would otherwise land in the next variant's time; and after a ``gc.collect()``:
a full collection in this process takes ~130 ms, ~15 % of a fit here, and otherwise fell into
one timed fit of one variant or another per run, whenever building the models had filled the
oldest generation); the best of the
rounds is kept for each variant (``overhead``: best against best), and every round's time is in
``samples``; ``round_overhead`` is the median over rounds of the overhead against the same
round's fit without a callback. Where the overhead goes: ``cpu_s`` is each variant's median process
CPU per fit (all threads: XLA's and the savers'), ``cpu_overhead`` the median over rounds of its
difference to the same round's fit without a callback; for this package's callback,
``blocking_s`` is the median over rounds of the fit's saves' summed blocking time (the epoch-end
hooks' snapshots) and ``last_save_s`` of its last save's background part (write, commit,
retention: what `on_train_end` waits for, less whatever ran before it was called).
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import time

import numpy as np

__all__ = ["run", "VARIANTS"]

VARIANTS = ("none", "ckpt_callbacks", "keras-ModelCheckpoint", "keras-OrbaxCheckpoint")


def _keras():
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    if keras.config.backend() != "jax":
        raise RuntimeError(f"Keras runs on the {keras.config.backend()!r} backend (set KERAS_BACKEND=jax)")
    return keras


def _callback(keras, variant: str, d: str):
    if variant == "none":
        return []
    if variant == "ckpt_callbacks":
        from .keras import AsyncCheckpoint
        return [AsyncCheckpoint(d, keep_last=2)]
    if variant == "keras-ModelCheckpoint":
        os.makedirs(d, exist_ok=True)
        return [keras.callbacks.ModelCheckpoint(os.path.join(d, "model.keras"), save_freq="epoch")]
    if not hasattr(keras.callbacks, "OrbaxCheckpoint"):
        raise RuntimeError(f"keras {keras.__version__} has no keras.callbacks.OrbaxCheckpoint")
    return [keras.callbacks.OrbaxCheckpoint(os.path.abspath(d), save_freq="epoch", max_to_keep=2)]


def _model(keras, width: int, features: int, classes: int):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,))]
                             + [keras.layers.Dense(width, activation="relu") for _ in range(3)]
                             + [keras.layers.Dense(classes)])
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run(ctx, row) -> list:
    try:
        keras = _keras()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [row(ctx, "fit", v, case="", skipped=f"{type(e).__name__}: {e}") for v in VARIANTS]
    width = max(16, int(round(1024 * math.sqrt(ctx.scale) / 16)) * 16)
    features, classes, batch = 512, 10, 128
    samples = max(2 * batch, int(round(2048 * ctx.scale / batch)) * batch)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, features), np.float32)
    y = rng.integers(0, classes, samples)
    times: dict = {v: [] for v in VARIANTS}
    cpus: dict = {v: [] for v in VARIANTS}
    parts: dict = {"blocking_s": [], "last_save_s": []}
    skipped: dict = {}
    state_bytes = files = 0
    for r in range(ctx.fit_repeats):
        for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            if v in skipped:
                continue
            d = os.path.join(ctx.root, f"fit-{v}-{r}")
            shutil.rmtree(d, ignore_errors=True)
            try:
                cbs = _callback(keras, v, d)
            except Exception as e:  # noqa: BLE001 - e.g. ckpt_callbacks.keras not importable yet
                skipped[v] = f"{type(e).__name__}: {e}"
                continue
            model = _model(keras, width, features, classes)
            model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, epochs=1, verbose=0)  # compile
            state_bytes = sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in
                              model.trainable_variables + model.optimizer.variables)
            os.sync()   # the previous variant's unflushed writes are not this one's to pay for
            gc.collect()   # nor the garbage of building the models (a full collection: ~130 ms)
            c0, t0 = time.process_time(), time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=ctx.fit_epochs, verbose=0, callbacks=cbs, shuffle=False)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            times[v].append(dt)
            cpus[v].append(cpu)
            if v == "ckpt_callbacks":
                files = sum(len(fs) for _, _, fs in os.walk(d))
                hist = cbs[0].manager.history
                parts["blocking_s"].append(sum(h.blocking_s for h in hist))
                parts["last_save_s"].append(hist[-1].total_s - hist[-1].blocking_s + hist[-1].gc_s if hist else 0.0)
            ctx.say(f"  fit/{ctx.storage} {v} #{r + 1}: {dt:.3f}s for {ctx.fit_epochs} epochs")
            del model, cbs
            shutil.rmtree(d, ignore_errors=True)
    base = min(times["none"]) if times["none"] else None
    rows = []
    for v in VARIANTS:
        if v in skipped:
            rows.append(row(ctx, "fit", v, case="", skipped=skipped[v]))
            continue
        t = min(times[v])
        per_round = [a / b - 1.0 for a, b in zip(times[v], times["none"])]   # same round, same noise
        cpu_round = [a - b for a, b in zip(cpus[v], cpus["none"])]
        ours = {"files": files, **{k: statistics.median(x) for k, x in parts.items() if x}} \
            if v == "ckpt_callbacks" else {}
        rows.append(row(ctx, "fit", v, case=f"{ctx.fit_epochs} epochs", fit_s=t, bytes=state_bytes,
                        overhead=(t / base - 1.0) if base else None,
                        round_overhead=statistics.median(per_round) if per_round else None, repeats=len(times[v]),
                        cpu_s=statistics.median(cpus[v]),
                        cpu_overhead=statistics.median(cpu_round) if cpu_round else None,
                        samples=[round(s, 4) for s in times[v]], **ours))
    return rows
