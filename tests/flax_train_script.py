"""A small, complete Flax training run with a Grain iterator and a CheckpointHook (tests/test_flax.py).

Run it again after it was killed, with the same command line: it resumes by itself.

    python tests/flax_train_script.py --framework nnx|linen --dir CKPT --steps 24 --log LOG.jsonl

Prints ``start S`` (the step it resumes from), ``step N`` after every hook call, then ``done N``
or ``stopped N`` (preempted: the hook saved step N). Each step appends ``{"step", "batch"}`` (the
record ids of the batch) to the --log file. When stdin is a pipe it reads one line after each
step, so a test can stop it at an exact step; otherwise it runs freely.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time

import signal

import grain
import grain.python as gp
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ckpt_callbacks as cc
from ckpt_callbacks.flax import CheckpointHook

N_RECORDS, BATCH, DIM = 40, 4, 6


def features(i):
    """Record `i` of the data set: (id, x, y), deterministic."""
    r = np.random.default_rng(int(i))
    x = r.standard_normal(DIM).astype(np.float32)
    return {"id": np.int32(i), "x": x, "y": np.float32(x.sum() * 0.5 + 1.0)}


def grain_dataset_iter():
    ds = grain.MapDataset.range(N_RECORDS).shuffle(seed=7).repeat(None).map(features).batch(BATCH)
    return iter(ds)


class _Features(gp.MapTransform):
    def map(self, i):
        return features(i)


def grain_loader_iter():
    loader = gp.DataLoader(
        data_source=gp.RangeDataSource(0, N_RECORDS, 1),
        sampler=gp.IndexSampler(N_RECORDS, shard_options=gp.NoSharding(), shuffle=True, num_epochs=None, seed=3),
        operations=[_Features(), gp.Batch(BATCH)], worker_count=0)
    return iter(loader)


def run_nnx(args, hook, it, lockstep):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(DIM, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.l2 = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.l1(x))))[:, 0]

    model = MLP(nnx.Rngs(params=0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    (model, optimizer), step = hook.restore_or_init((model, optimizer), data_iterator=it)
    return _loop(args, hook, it, lockstep, step, lambda b: train_step(model, optimizer, b["x"], b["y"]),
                 lambda: (model, optimizer))


def run_linen(args, hook, it, lockstep):
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            h = nn.relu(nn.Dense(16)(x))
            h = nn.Dropout(0.2, deterministic=not train)(h)
            return nn.Dense(1)(h)[:, 0]

    class State(train_state.TrainState):
        key: jax.Array

    m = MLP()
    params = m.init(jax.random.key(0), jnp.zeros((1, DIM)), False)["params"]
    state = State.create(apply_fn=m.apply, params=params, tx=optax.adamw(1e-2), key=jax.random.key(1))
    state = state.replace(step=jnp.asarray(0, jnp.int32))

    def train_step(state, x, y):
        key = jax.random.fold_in(state.key, state.step)

        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, x, True, rngs={"dropout": key}) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    train_step = jax.jit(train_step, donate_argnums=0)
    state, step = hook.restore_or_init(state, data_iterator=it)
    box = [state]

    def one(b):
        box[0], loss = train_step(box[0], b["x"], b["y"])
        return loss
    return _loop(args, hook, it, lockstep, step, one, lambda: box[0])


def _loop(args, hook, it, lockstep, step, train_one, current):
    print(f"start {step}", flush=True)
    with open(args.log, "a") as log:
        while step < args.steps:
            batch = next(it)
            train_one(batch)
            step += 1
            log.write(json.dumps({"step": step, "batch": [int(i) for i in batch["id"]]}) + "\n")
            log.flush()
            metrics = None
            if args.eval_every and step % args.eval_every == 0:
                metrics = {"val_loss": float((step * 37) % 11)}
            hook(step, current(), metrics=metrics)
            print(f"step {step}", flush=True)
            if hook.should_stop:
                hook.close()
                print(f"stopped {step}", flush=True)
                return
            if lockstep:
                sys.stdin.readline()
    hook.save(step, current())
    hook.close()
    print(f"done {step}", flush=True)


def two_process_preemption(root: str) -> dict:
    """Run by tests/multiproc.py in each of 2 `jax.distributed` processes: only process 1 gets
    SIGTERM (after step 3); both must save step 4 together and stop there."""
    it = grain_dataset_iter()
    hook = CheckpointHook(root, every_steps=100)
    state, step = hook.restore_or_init({"w": np.zeros(4, np.float32)}, data_iterator=it)
    while step < 10:
        batch = next(it)
        state = {"w": state["w"] + batch["x"].sum(0)[:4]}
        step += 1
        hook(step, state)
        if hook.should_stop:
            break
        if step == 3 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    hook.close()
    m = hook.manager
    return {"stopped": step, "steps": m.all_steps(), "host": m.host_state(step),
            "w": [float(v) for v in m.restore(step)["w"]]}


def two_hooks_on_one_manager(root: str) -> dict:
    """Run in each of 2 processes: two hooks, one after the other, on one manager of the user's.
    Each hook call agrees over the key-value store; the second hook must not reuse the first's keys."""
    mngr = cc.CheckpointManager(root, timeout_s=30)
    started = []
    for phase in range(2):
        with CheckpointHook(mngr, every_steps=2) as hook:
            state, step = hook.restore_or_init({"w": np.zeros(4, np.float32)})
            for s in range(step + 1, step + 4):
                started.append(bool(hook(s, {"w": np.full(4, s, np.float32)})))
    mngr.wait_until_finished()
    steps = mngr.all_steps()
    coord = mngr.coord   # each process dropped its part of every agreement but the last one
    coord.barrier("agreements-counted", 30)
    left = sorted(k.rsplit("/", 2)[-2] for k, _ in coord.client.key_value_dir_get_bytes(coord._key("hook/")))
    mngr.close()
    return {"started": started, "steps": steps, "agreements_left": left}


def restore_while_a_save_commits(root: str) -> dict:
    """Run in each of 2 processes: a manager of the user's saves step 1, and a hook on it resumes
    at once. Process 0 (slower here) lists after the commit landed, process 1 before it: each
    deciding for itself, process 0 restored step 1 while process 1 started afresh at step 0."""
    mngr = cc.CheckpointManager(root, timeout_s=30)
    mngr.save(1, {"w": np.ones(4, np.float32)})
    if jax.process_index() == 0:
        mngr.wait_until_finished()
    hook = CheckpointHook(mngr, every_steps=100, preemption_signals=())
    state, step = hook.restore_or_init({"w": np.zeros(4, np.float32)})
    hook.close()
    mngr.close()
    return {"step": step, "w": state["w"].tolist()}


class _FailingOnce:
    """A data position whose `get_state` fails once, at `fail_at`, on this process only."""

    def __init__(self, fail_at):
        self.pos, self.fail_at = 0, fail_at

    def get_state(self):
        if self.pos == self.fail_at:
            self.fail_at = None
            raise RuntimeError(f"get_state failed at position {self.pos}")
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = state["pos"]


def iterator_fails_on_one_process(root: str) -> dict:
    """Run in each of 2 processes: process 1's data iterator fails to give its state at step 2.
    Process 1 raised alone, before its save's agreement; process 0 waited in it for timeout_s (or
    until JAX's heartbeat ended it, raising nothing), and their save counters stayed apart."""
    it = _FailingOnce(2 if jax.process_index() == 1 else None)
    mngr = cc.CheckpointManager(root, timeout_s=20)
    hook = CheckpointHook(mngr, every_steps=1, data_iterator=it, preemption_signals=())
    errors = []
    for step in (1, 2, 3):
        it.pos = step
        t0 = time.monotonic()
        try:
            hook(step, {"w": np.full(4, step, np.float32)})
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append([type(e).__name__, str(e), round(time.monotonic() - t0, 1)])
    hook.close()
    mngr.close()
    steps = mngr.all_steps()
    return {"errors": errors, "steps": steps, "host": mngr.host_state(3) if 3 in steps else None}


def survivor_of_a_dead_process(root: str, timeout_s: float) -> dict:
    """Run in each of 2 processes: process 1 dies after step 1; process 0's next hook call must
    raise within the hook's `timeout_s` (the hook had none: with the manager's 600 s, JAX's
    heartbeat terminates the survivor first, raising nothing)."""
    hook = CheckpointHook(root, every_steps=1, preemption_signals=(), timeout_s=timeout_s)
    state, step = hook.restore_or_init({"w": np.zeros(4, np.float32)})
    hook(1, state)
    hook.wait_until_finished()
    if jax.process_index() == 1:
        os._exit(17)
    t0 = time.monotonic()
    try:
        hook(2, state)
        return {"error": None}
    except cc.CheckpointError as e:
        return {"error_type": type(e).__name__, "error": str(e), "waited_s": time.monotonic() - t0}


def metrics_refused_on_one_process(root: str) -> dict:
    """Run in each of 2 processes: at step 2 process 0 passes metrics that are no dict (its own
    evaluation's bare float), process 1 none. Process 0 raised alone, before the hook's
    agreement; process 1 waited there, and the processes' hook calls stayed paired off by one."""
    hook = CheckpointHook(root, every_steps=1, preemption_signals=(), timeout_s=20)
    errors = []
    for step in (1, 2, 3):
        metrics = 0.5 if step == 2 and jax.process_index() == 0 else None
        t0 = time.monotonic()
        try:
            hook(step, {"w": np.full(4, step, np.float32)}, metrics=metrics)
            errors.append(None)
        except cc.CheckpointError as e:
            errors.append([type(e).__name__, str(e), round(time.monotonic() - t0, 1)])
    hook.close()
    return {"errors": errors, "steps": hook.manager.all_steps()}


def steps_apart(root: str) -> dict:
    """Run in each of 2 processes: after step 1, process 0 calls the hook with step 2 and process
    1 with step 3 (a step counted apart). Each decided its schedule alone: process 0 saved step 2
    and waited in that save for process 1, which had skipped it, until timeout_s."""
    hook = CheckpointHook(root, every_steps=2, preemption_signals=(), timeout_s=10)
    errors = []
    for step in (1, 2 + jax.process_index(), 4):
        t0 = time.monotonic()
        try:
            hook(step, {"w": np.full(4, step, np.float32)})
            errors.append(None)
        except cc.CheckpointError as e:
            errors.append([type(e).__name__, str(e), round(time.monotonic() - t0, 1)])
    hook.close()
    return {"errors": errors, "steps": hook.manager.all_steps()}


def main():
    jax.config.update("jax_num_cpu_devices", 2)     # before any device is used
    jax.config.update("jax_platforms", "cpu")
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=["nnx", "linen"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    lockstep = stat.S_ISFIFO(os.fstat(0).st_mode)
    it = grain_dataset_iter() if args.framework == "nnx" else grain_loader_iter()
    hook = CheckpointHook(args.dir, every_steps=args.every, retention=cc.KeepLast(2))
    (run_nnx if args.framework == "nnx" else run_linen)(args, hook, it, lockstep)


if __name__ == "__main__":
    main()
