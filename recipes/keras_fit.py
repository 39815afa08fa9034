"""Keras recipe: `model.fit` on the JAX backend, checkpointed by `ckpt_callbacks.keras.AsyncCheckpoint`.

Example::

    python recipes/keras_fit.py --config recipes/keras_fit.yaml                       # trains, saves
    python recipes/keras_fit.py --config recipes/keras_fit.yaml --set train.epochs=12  # resumes

Who calls what, in order, on one process: the config is loaded; the model is built and
compiled; `model.fit` calls the callback: `on_train_begin` restores the latest committed step
(weights, optimizer, metrics, RNG state, epoch/batch position) when ``resume: latest``;
`on_epoch_end` saves asynchronously with the epoch's logs as metrics (``val_*`` exist only
there), so ``keep_best`` ranks epochs by ``val_accuracy``; `on_train_end` waits for the last
save and applies retention. ``checkpoint.save_interval_steps`` absent means "every epoch";
present, it is Keras' ``save_freq`` in batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_mlp import load_data  # noqa: E402  (the same data as the main job)

TRAIN_DEFAULTS = {"epochs": 8, "batch_size": 64, "hidden": 128, "lr": 2e-3, "seed": 0}
RESUME_MODES = ("latest", "off")   # AsyncCheckpoint(resume=True|False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_fit.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--summary-json", help="also write the summary as JSON here")
    args = p.parse_args(argv)
    from ckpt_callbacks.config import load_config
    cfg = load_config(args.config, train_defaults=TRAIN_DEFAULTS, overrides=args.set, resume_modes=RESUME_MODES)
    t, c = cfg.train, cfg.checkpoint

    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    from ckpt_callbacks.keras import AsyncCheckpoint

    keras.utils.set_random_seed(t["seed"])
    (xtr, ytr), (xva, yva) = load_data(t["seed"])
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(t["hidden"], activation="relu"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(t["lr"]),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    interval = "save_interval_steps" in (cfg.raw.get("checkpoint") or {})
    cb = AsyncCheckpoint(c.directory, save_freq=c.save_interval_steps if interval else "epoch",
                         monitor="val_accuracy", mode="max", retention=c.policies, resume=c.resume is not None,
                         async_save=c.async_save, max_staging_bytes=c.max_staging_bytes, verbose=1,
                         # numpy input: a mid-epoch resume restarts that epoch (exact mid-epoch resume needs
                         # a ResumableDataset, docs/keras.md); irrelevant when saving every epoch
                         data=False if interval else None)
    hist = model.fit(xtr, ytr, validation_data=(xva, yva), batch_size=t["batch_size"], epochs=t["epochs"],
                     shuffle=True, callbacks=[cb], verbose=2)
    import ckpt_callbacks as cc
    mngr = cc.CheckpointManager(c.directory, read_only=True, retention=c.policies)
    best = mngr.best_step()
    summary = {"epochs_run": len(hist.history.get("loss", [])), "kept": mngr.all_steps(), "best_step": best,
               "best_metrics": mngr.metrics(best) if best is not None else None}
    print(f"epochs run now: {summary['epochs_run']}; steps kept: {summary['kept']}; best step {best} "
          f"(val_accuracy {(summary['best_metrics'] or {}).get('val_accuracy')})")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
