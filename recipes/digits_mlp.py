"""The main job: train a small MLP on scikit-learn's digits with async checkpoints, get killed, resume.

Example (a fresh machine with Python 3.11; see README.md)::

    python recipes/digits_mlp.py --config recipes/digits_mlp.yaml
    python recipes/digits_mlp.py --config recipes/digits_mlp.yaml --set train.steps=60 \
        --set train.interrupt_at=30 --set checkpoint.directory=/tmp/digits --timeline /tmp/digits.html

What happens, in order, on one process:
  1. The config is loaded (`ckpt_callbacks.config.load_config`): where checkpoints go, how often,
     async on/off, retention (keep the last N and the best N by validation accuracy), resume mode.
  2. If ``train.interrupt_at`` is set and the directory has not reached it yet, the script runs
     itself as a child process that trains and is killed with SIGKILL right after step
     ``interrupt_at`` (while that step's checkpoint may still be being written).
  3. This process then opens the same directory: the manager removes the dead run's partial
     save, and training resumes from the latest committed step (``resume: latest``; ``best``,
     a step, or ``off`` also work), data-iterator position included, until ``train.steps``.
  4. It prints a summary: steps saved, kept, the best step (restored and re-evaluated), and how
     long training stalled for snapshots versus how long the background writes took.

The train step donates its state (``donate_argnums``), so each save must snapshot the buffers
before the next step deletes them; an interrupted-and-resumed run ends bit-identical to an
uninterrupted one (tests/test_recipes.py checks this).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

TRAIN_DEFAULTS = {"steps": 400, "batch_size": 64, "hidden": 128, "lr": 2e-3, "seed": 0,
                  "eval_every": 25, "interrupt_at": 0}


class BatchIterator:
    """Shuffled mini-batches, epoch after epoch; `get_state`/`set_state` make its position checkpointable."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.bs, self.seed = n, batch_size, seed
        self.epoch, self.index = 0, 0

    def __next__(self):
        import numpy as np
        per_epoch = self.n // self.bs
        if self.index >= per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        idx = perm[self.index * self.bs:(self.index + 1) * self.bs]
        self.index += 1
        return idx

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def load_data(seed: int):
    import numpy as np
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    tr, va = perm[:cut], perm[cut:]
    return (x[tr], y[tr].astype(np.int32)), (x[va], y[va].astype(np.int32))


def build(train: dict):
    """The initial state and the jitted train/eval functions (pure JAX + optax)."""
    import jax
    import jax.numpy as jnp
    import optax
    opt = optax.adam(train["lr"])
    k1, k2, k3 = jax.random.split(jax.random.key(train["seed"]), 3)
    h = train["hidden"]
    params = {"l1": {"w": jax.random.normal(k1, (64, h)) * (2 / 64) ** 0.5, "b": jnp.zeros(h)},
              "l2": {"w": jax.random.normal(k2, (h, h)) * (2 / h) ** 0.5, "b": jnp.zeros(h)},
              "out": {"w": jax.random.normal(k3, (h, 10)) * (1 / h) ** 0.5, "b": jnp.zeros(10)}}
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.key(train["seed"] + 1)}

    def logits(p, x, rng=None):
        a = jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"])
        if rng is not None:   # dropout, so that the RNG key is part of the state that must resume exactly
            a = a * jax.random.bernoulli(rng, 0.9, a.shape) / 0.9
        a = jax.nn.relu(a @ p["l2"]["w"] + p["l2"]["b"])
        return a @ p["out"]["w"] + p["out"]["b"]

    def loss_fn(p, x, y, rng):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, x, rng), y).mean()

    @jax.jit
    def evaluate(p, x, y):
        lg = logits(p, x)
        return (optax.softmax_cross_entropy_with_integer_labels(lg, y).mean(),
                (lg.argmax(-1) == y).mean())

    def step_fn(s, x, y):
        rng, sub = jax.random.split(s["rng"])
        loss, g = jax.value_and_grad(loss_fn)(s["params"], x, y, sub)
        updates, opt_state = opt.update(g, s["opt_state"], s["params"])
        return {"params": optax.apply_updates(s["params"], updates), "opt_state": opt_state,
                "step": s["step"] + 1, "rng": rng}, loss

    return state, jax.jit(step_fn, donate_argnums=0), evaluate


def train(cfg, *, kill_at: int | None = None, log=print) -> dict:
    """Train to ``train.steps`` from wherever the checkpoint directory says; returns the summary."""
    from ckpt_callbacks.storage import open_store
    t = cfg.train
    (xtr, ytr), (xva, yva) = load_data(t["seed"])
    state, train_step, evaluate = build(t)
    it = BatchIterator(len(xtr), t["batch_size"], t["seed"])
    leftovers = open_store(cfg.checkpoint.directory).leftovers()
    t0 = time.perf_counter()
    with cfg.checkpoint.manager() as mngr:
        start = cfg.checkpoint.resume_step(mngr)
        if start is not None:
            state = mngr.restore(start, target=state)
            it.set_state(mngr.host_state(start))
            log(f"resumed from step {start} (committed: {mngr.all_steps()}"
                + (f"; removed what the interrupted run left unfinished: {leftovers})" if leftovers else ")"))
        start = start or 0
        for step in range(start + 1, t["steps"] + 1):
            idx = next(it)
            state, loss = train_step(state, xtr[idx], ytr[idx])
            metrics = None
            if step % t["eval_every"] == 0:
                val_loss, val_acc = evaluate(state["params"], xva, yva)
                metrics = {"loss": float(loss), "val_loss": float(val_loss), "val_accuracy": float(val_acc)}
                log(f"step {step}: loss {float(loss):.4f} val_loss {float(val_loss):.4f} val_accuracy {float(val_acc):.4f}")
            mngr.save(step, state, metrics=metrics, host_state=it.get_state())
            if kill_at is not None and step == kill_at:
                log(f"step {step}: killing this process (SIGKILL) while its checkpoint may still be in flight")
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        mngr.wait_until_finished()
        train_s = time.perf_counter() - t0
        hist = mngr.history
        best = mngr.best_step()
        summary = {"directory": cfg.checkpoint.directory, "resumed_from": start if start else None,
                   "final_step": t["steps"], "saved_this_run": [h.step for h in hist], "kept": mngr.all_steps(),
                   "best_step": best, "best_metrics": mngr.metrics(best) if best is not None else None,
                   "stall_s": sum(h.blocking_s for h in hist), "write_s": sum(h.write_s + h.commit_s for h in hist),
                   "gc_s": sum(h.gc_s for h in hist), "train_s": train_s,
                   "bytes_per_save": hist[-1].bytes_total if hist else 0}
        if best is not None:   # the best checkpoint restores and evaluates to what was recorded
            restored = mngr.restore(best, target=state)
            _, acc = evaluate(restored["params"], xva, yva)
            summary["best_reevaluated_val_accuracy"] = float(acc)
        summary["history"] = [h.as_dict() for h in hist]
    return summary


def print_summary(s: dict, out=sys.stdout) -> None:
    n = len(s["saved_this_run"])
    bm = s["best_metrics"] or {}
    out.write("\n== summary ==\n")
    out.write(f"checkpoints in {s['directory']}\n")
    out.write(f"resumed from step: {s['resumed_from'] if s['resumed_from'] is not None else 'none (fresh start)'}; "
              f"trained to step {s['final_step']} in {s['train_s']:.1f} s\n")
    out.write(f"steps saved by this run: {n} ({s['bytes_per_save'] / 1e3:.0f} KB each)\n")
    out.write(f"steps kept: {s['kept']}\n")
    if s["best_step"] is not None:
        out.write(f"best step: {s['best_step']} (val_accuracy {bm.get('val_accuracy', float('nan')):.4f}; restored and "
                  f"re-evaluated: {s['best_reevaluated_val_accuracy']:.4f})\n")
    stall, write = s["stall_s"], s["write_s"]
    out.write(f"training stalled {stall:.3f} s for {n} snapshots ({1000 * stall / max(n, 1):.1f} ms each); "
              f"background write+commit took {write:.3f} s ({write / max(stall, 1e-9):.1f}x the stall), "
              f"retention {s['gc_s']:.3f} s\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits_mlp.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=60 (repeatable)")
    p.add_argument("--timeline", help="also write the save timeline of this run (HTML) here")
    p.add_argument("--summary-json", help="also write the summary as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from ckpt_callbacks.config import load_config
    from ckpt_callbacks.storage import open_store
    cfg = load_config(args.config, train_defaults=TRAIN_DEFAULTS, overrides=args.set)
    kill_at = cfg.train["interrupt_at"] or None
    if kill_at is not None and kill_at >= cfg.train["steps"]:
        print(f"train.interrupt_at={kill_at} is not below train.steps={cfg.train['steps']}: training without "
              f"an interruption (e.g. --set train.interrupt_at={cfg.train['steps'] // 2} to see one)", flush=True)
        kill_at = None
    if args.child:
        train(cfg, kill_at=kill_at, log=lambda m: print(f"[run 1] {m}", flush=True))
        return 0
    committed = open_store(cfg.checkpoint.directory).committed_steps()
    if kill_at and (not committed or committed[-1] < kill_at) and cfg.checkpoint.resume is not None:
        print(f"run 1: training in a child process that will be killed after step {kill_at}", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--child"]
        cmd += [x for s in args.set for x in ("--set", s)]
        rc = subprocess.run(cmd).returncode
        print(f"run 1: exited with {rc} ({'killed by SIGKILL' if rc == -signal.SIGKILL else 'unexpected'}); "
              f"committed steps now: {open_store(cfg.checkpoint.directory).committed_steps()}", flush=True)
        if rc != -signal.SIGKILL:
            return 1
        print("run 2: resuming in this process", flush=True)
    summary = train(cfg)
    print_summary(summary)
    if args.timeline:
        from ckpt_callbacks import timeline
        from ckpt_callbacks.writing import SaveStats
        with open(args.timeline, "w") as f:
            f.write(timeline.render_html(timeline.records_from_stats([SaveStats(**h) for h in summary["history"]]),
                                         source=f"recipes/digits_mlp.py, {cfg.checkpoint.directory}"))
        print(f"timeline of this run's saves: {args.timeline}")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
