"""Multi-process recipe: N local `jax.distributed` processes train one sharded model, stop, and a
different number of processes resumes it (the checkpoint is resharded onto the new mesh).

Example::

    python recipes/multiprocess.py --config recipes/multiprocess.yaml

Who calls what, in order: this launcher (one process, no JAX devices) starts
``train.processes`` workers on 127.0.0.1, each with ``train.devices_per_process`` CPU devices and
gloo collectives, and waits for them; each worker calls `jax.distributed.initialize`, builds the
same `CheckpointManager` from the config (SPMD: same calls, same order on every process), trains
to ``train.stop_at`` and closes the manager. Each process writes only the shards it owns; process 0
commits. The launcher then starts ``train.resume_processes`` workers, which restore the latest
committed step onto their own mesh (``restore(target=...)`` reads only the bytes each process
needs) and train to ``train.steps``. Run it on one machine; on a cluster, start the worker part
(``--worker``) on each host with the coordinator's address instead.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_mlp import BatchIterator, load_data  # noqa: E402

TRAIN_DEFAULTS = {"steps": 120, "stop_at": 60, "processes": 2, "resume_processes": 1, "devices_per_process": 2,
                  "batch_size": 64, "hidden": 128, "lr": 2e-3, "seed": 0, "eval_every": 20, "timeout_s": 300}


def worker(cfg, pid: int, nprocs: int, port: int, stop_at: int) -> None:
    import jax
    t = cfg.train
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", t["devices_per_process"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", nprocs, pid, initialization_timeout=60)
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep, by_data, hidden_sharded = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")),
                                    NamedSharding(mesh, P(None, "data")))

    def put(x, sharding):   # the same numpy value on every process -> one global array
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    (xtr, ytr), (xva, yva) = load_data(t["seed"])
    rng = np.random.default_rng(t["seed"])
    h = t["hidden"]
    params = {"l1": {"w": put(rng.standard_normal((64, h), np.float32) * (2 / 64) ** 0.5, hidden_sharded),
                     "b": put(np.zeros(h, np.float32), by_data)},
              "out": {"w": put(rng.standard_normal((h, 10), np.float32) * (1 / h) ** 0.5, NamedSharding(mesh, P("data", None))),
                      "b": put(np.zeros(10, np.float32), rep)}}
    opt = optax.adam(t["lr"])
    state = {"params": params, "opt_state": opt.init(params), "step": put(np.int32(0), rep)}
    # optax creates its step counter on one device: make every leaf a global array on the mesh
    state = jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else put(np.asarray(x), rep), state)
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def logits(p, x):
        return jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["out"]["w"] + p["out"]["b"]

    def step_fn(s, x, y):
        loss, g = jax.value_and_grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean())(s["params"])
        updates, opt_state = opt.update(g, s["opt_state"], s["params"])
        return {"params": optax.apply_updates(s["params"], updates), "opt_state": opt_state, "step": s["step"] + 1}, loss

    train_step = jax.jit(step_fn, out_shardings=(shardings, rep), donate_argnums=0)
    evaluate = jax.jit(lambda p, x, y: (logits(p, x).argmax(-1) == y).mean(), out_shardings=rep)
    xv, yv = put(xva, rep), put(yva, rep)
    it = BatchIterator(len(xtr), t["batch_size"], t["seed"])
    say = (lambda m: print(f"[{nprocs} processes] {m}", flush=True)) if pid == 0 else (lambda m: None)
    with cfg.checkpoint.manager() as mngr:
        start = cfg.checkpoint.resume_step(mngr)
        if start is not None:
            state = mngr.restore(start, target=state)   # onto this run's mesh, whatever the saving mesh was
            # every process draws the same global batches, so process 0's position is everyone's
            # (with per-process pipelines, map saved processes to new ones: see host_state's remap)
            it.set_state(mngr.host_state(start, process_index=0))
            say(f"resumed step {start} onto a {len(jax.devices())}-device mesh "
                f"({jax.local_device_count()} devices per process)")
        for step in range((start or 0) + 1, stop_at + 1):
            idx = next(it)
            state, loss = train_step(state, put(xtr[idx], by_data), put(ytr[idx], by_data))
            metrics = None
            if step % t["eval_every"] == 0:
                metrics = {"loss": float(loss), "val_accuracy": float(evaluate(state["params"], xv, yv))}
                say(f"step {step}: loss {metrics['loss']:.4f} val_accuracy {metrics['val_accuracy']:.4f}")
            mngr.save(step, state, metrics=metrics, host_state=it.get_state())
        mngr.wait_until_finished()   # all_steps() lists committed steps: the save of stop_at may be in flight
        if stop_at not in mngr.all_steps() and (start or 0) < stop_at:
            mngr.save(stop_at, state, force=True, host_state=it.get_state())
            mngr.wait_until_finished()
        h = mngr.history
        say(f"committed {mngr.all_steps()}; this process wrote {sum(s.bytes_written for s in h) / 1e3:.0f} KB "
            f"and stalled {sum(s.blocking_s for s in h):.3f} s over {len(h)} saves")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, n: int, stop_at: int, timeout_s: float) -> int:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    base = [sys.executable, os.path.abspath(__file__), "--config", args.config] + [x for s in args.set for x in ("--set", s)]
    procs = [subprocess.Popen(base + ["--worker", str(i), str(n), str(port), str(stop_at)], env=env) for i in range(n)]
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            rcs.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return 0 if all(rc == 0 for rc in rcs) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--worker", nargs=4, type=int, metavar=("ID", "N", "PORT", "STOP_AT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from ckpt_callbacks.config import load_config
    cfg = load_config(args.config, train_defaults=TRAIN_DEFAULTS, overrides=args.set)
    t = cfg.train
    if args.worker:
        worker(cfg, *args.worker)
        return 0
    print(f"run 1: {t['processes']} processes x {t['devices_per_process']} devices, steps 1..{t['stop_at']}", flush=True)
    if launch(args, t["processes"], t["stop_at"], t["timeout_s"]):
        print("run 1 failed", file=sys.stderr)
        return 1
    print(f"run 2: {t['resume_processes']} process(es) x {t['devices_per_process']} devices resume, "
          f"up to step {t['steps']}", flush=True)
    if launch(args, t["resume_processes"], t["steps"], t["timeout_s"]):
        print("run 2 failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
