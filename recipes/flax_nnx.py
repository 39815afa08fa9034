"""Flax NNX recipe: a hand-written training loop checkpointed by `ckpt_callbacks.flax.CheckpointHook`.

Example::

    python recipes/flax_nnx.py --config recipes/flax_nnx.yaml                       # trains, saves
    python recipes/flax_nnx.py --config recipes/flax_nnx.yaml --set train.steps=600  # resumes, continues

Who calls what, in order, on one process: the config is loaded; the NNX model, optimizer and
data iterator are built; `hook.restore_or_init` restores the latest committed step into them in
place (model, optimizer state, RNG streams, iterator position) or returns step 0; the loop calls
`hook(step, (model, optimizer), metrics=...)` after every step (metrics on evaluation steps, so
those steps rank for ``keep_best``); `hook.close()` waits for the last save. SIGTERM makes the hook
save the current step and set `hook.should_stop`; the loop then exits cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_mlp import BatchIterator, load_data  # noqa: E402  (same data and batches as the main job)

TRAIN_DEFAULTS = {"steps": 300, "batch_size": 64, "hidden": 128, "lr": 2e-3, "seed": 0, "eval_every": 25}
RESUME_MODES = ("latest",)   # CheckpointHook.restore_or_init resumes from the latest committed step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "flax_nnx.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--summary-json", help="also write the summary as JSON here")
    args = p.parse_args(argv)
    from ckpt_callbacks.config import load_config
    cfg = load_config(args.config, train_defaults=TRAIN_DEFAULTS, overrides=args.set, resume_modes=RESUME_MODES)
    t = cfg.train

    import jax
    import optax
    from flax import nnx
    from ckpt_callbacks.flax import CheckpointHook

    class MLP(nnx.Module):
        def __init__(self, hidden, rngs):
            self.l1 = nnx.Linear(64, hidden, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(hidden, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.relu(self.l1(x))))

    (xtr, ytr), (xva, yva) = load_data(t["seed"])
    model = MLP(t["hidden"], nnx.Rngs(t["seed"]))
    optimizer = nnx.Optimizer(model, optax.adam(t["lr"]), wrt=nnx.Param)
    it = BatchIterator(len(xtr), t["batch_size"], t["seed"])

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def evaluate(model, x, y):
        model.eval()
        lg = model(x)
        model.train()
        return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean(), (lg.argmax(-1) == y).mean()

    # The hook owns the schedule (every_steps, plus every step that comes with eval metrics), so
    # the manager built from the config saves whenever the hook asks (interval 1).
    mngr = cfg.checkpoint.manager(save_interval_steps=1)
    hook = CheckpointHook(mngr, every_steps=cfg.checkpoint.save_interval_steps)
    (model, optimizer), start = hook.restore_or_init((model, optimizer), data_iterator=it)
    print(f"starting at step {start}" + (f" (resumed; committed: {mngr.all_steps()})" if start else ""))
    for step in range(start + 1, t["steps"] + 1):
        idx = next(it)
        loss = train_step(model, optimizer, xtr[idx], ytr[idx])
        metrics = None
        if step % t["eval_every"] == 0:
            vl, va = evaluate(model, xva, yva)
            metrics = {"loss": float(loss), "val_loss": float(vl), "val_accuracy": float(va)}
            print(f"step {step}: val_loss {float(vl):.4f} val_accuracy {float(va):.4f}")
        hook(step, (model, optimizer), metrics=metrics)
        if hook.should_stop:
            print(f"preempted: step {step} is committed; exiting")
            break
    else:
        if t["steps"] > start and hook.last_saved_step != t["steps"]:
            hook.save(t["steps"], (model, optimizer))   # the final step, whatever the schedule
    hook.close()
    best = mngr.best_step()
    summary = {"resumed_from": start or None, "kept": mngr.all_steps(), "best_step": best,
               "best_metrics": mngr.metrics(best) if best is not None else None,
               "stall_s": sum(h.blocking_s for h in mngr.history), "saved_this_run": [h.step for h in mngr.history]}
    mngr.close()
    print(f"kept {summary['kept']}, best {best} {summary['best_metrics']}, "
          f"stalled {summary['stall_s']:.3f} s for {len(mngr.history)} saves")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
