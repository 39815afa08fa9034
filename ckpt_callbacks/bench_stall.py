"""The `stall` workload of `ckpt-callbacks bench`: how long a save stalls training on an
accelerator (GPU, TPU), against the device-to-host bandwidth measured in the same run.

Example (what ``ckpt-callbacks bench --workloads stall`` runs; on CPU alone the row says "skipped")::

    from ckpt_callbacks import bench_stall, bench_workloads as bw
    rows = list(bench_stall.run(bw.Context(root="/dev/shm/b", storage="tmpfs", scale=0.01), bw._row))

Who calls what: `bench_workloads.run_stall` on the main thread of the cell's child process, which,
for this workload alone, keeps JAX's default backend (no 8 CPU devices; ``--in-process`` runs on
those, so there the row says "skipped"). `run` takes the local devices of that backend
(`accelerator_devices`), or those it is given (the tests pass CPU devices).

What it measures, on the big tree (16 float32 4096x4096 leaves, 1 GiB at ``--scale 1``; over a 4x2
mesh with 8 devices or more, else over all of them in a row):

- ``d2h`` rows: the whole tree copied to host memory, ``jax.device_put`` onto memory kind
  ``pinned_host`` (every leaf dispatched, then waited for: the pinned device-to-host bandwidth,
  what issue #10's goal is stated against) and ``jax.device_get`` into numpy (pageable memory);
  fresh arrays each time, best of ``repeats``.
- one row per peer (this package, Orbax: async savers both): a training loop of ``N`` donating
  steps (``a * 0.999 + 1e-3 * tanh(a @ a.T / n)`` per leaf) timed alone (``base_s``) and with a save
  called just before its first step (``loop_s``), each until the last step's result is ready
  (which of the two runs first alternates from round to round).
  ``stall_s`` = best ``loop_s`` - best ``base_s``: what the save cost the loop, the blocking part
  and whatever its background part (the transfer to host, the write) took from the steps
  (``round_stall_s``: the median over rounds of each round's difference; the loop alone varies
  by a few tens of ms from round to round on an H200, as much as the stall);
  ``blocking_s`` = time in ``save``; ``durable_s`` = from ``save`` until ``wait``, called on a
  thread beside the loop, returns (the save durable, whether or not the loop still runs); the
  restore onto the device (``restore_s``) is compared bit for bit with the values saved (which
  the first step donated). ``N`` makes the loop last 1.5x the slowest peer's save-to-durable time
  of an untimed warm-up round, so that the background part overlaps the steps.

The goal (issue #10): stall <= 1.25 x bytes / pinned bandwidth + 50 ms (`bench_report.targets`).
"""

from __future__ import annotations

import functools
import gc
import math
import os
import shutil
import statistics
import threading
import time

import jax
import jax.numpy as jnp

from . import bench_peers as bp

__all__ = ["run", "accelerator_devices", "PEERS"]

PEERS = ("ckpt_callbacks", "orbax")
MAX_STEPS = 5000


def accelerator_devices() -> list:
    """This process's devices of JAX's default backend when that is not the CPU, else []."""
    return [] if jax.default_backend() == "cpu" else list(jax.local_devices())


def _mesh(devices):
    shape = (4, 2) if len(devices) >= 8 else (len(devices), 1)
    return jax.make_mesh(shape, ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices[:math.prod(shape)])   # (Auto: the step's matmul picks its collectives)


@functools.partial(jax.jit, donate_argnums=0)
def _step(tree):
    return jax.tree.map(lambda a: a * 0.999 + 1e-3 * jnp.tanh(a @ a.T / a.shape[0]), tree)


_copy = jax.jit(lambda a: a.copy())


def _loop(state, steps: int, before=None) -> tuple[float, float]:
    """(seconds for `before(state)` then `steps` donating steps until ready, seconds in `before`)."""
    t0 = time.perf_counter()
    if before is not None:
        before(state)
    t1 = time.perf_counter()
    for _ in range(steps):
        state = _step(state)
    jax.block_until_ready(state)
    return time.perf_counter() - t0, t1 - t0


def _pinned(leaves) -> bool:
    dev = next(iter(leaves[0].sharding.device_set))
    return "pinned_host" in {m.kind for m in dev.addressable_memories()}


def _d2h_s(tree, kind: str) -> float:
    leaves = jax.tree.leaves(tree)
    t0 = time.perf_counter()
    if kind == "pinned_host":
        out = [jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in leaves]
        jax.block_until_ready(out)
    else:
        out = jax.device_get(leaves)
    dt = time.perf_counter() - t0
    del out
    return dt


def run(ctx, row, devices=None):
    """Yield the ``d2h`` rows, then one row per peer of ``ctx.peers`` in `PEERS`; see the module
    docstring. Without an accelerator (and no `devices`), one "skipped" row."""
    from .bench_workloads import abstract, big_tree, fresh, tree_bytes
    devices = accelerator_devices() if devices is None else list(devices)
    if not devices:
        yield row(ctx, "stall", "ckpt_callbacks", case="",
                  skipped=f"no accelerator: JAX's default backend is {jax.default_backend()}")
        return
    kind = devices[0].device_kind
    base = big_tree(ctx.scale, mesh=_mesh(devices))
    nbytes, target, check = tree_bytes(base), abstract(base), sorted(base)[0]
    where = dict(device=kind, devices=len(devices), platform=devices[0].platform)

    kinds = ["pinned_host", "pageable"] if _pinned(jax.tree.leaves(base)) else ["pageable"]
    d2h: dict = {k: [] for k in kinds}
    for r in range(ctx.repeats + 1):   # the first round is untimed (transfer set-up, allocations)
        for k in kinds:
            tree = fresh(base, -1 - r)
            s = _d2h_s(tree, k)
            del tree
            if r:
                d2h[k].append(s)
    for k in kinds:
        best = min(d2h[k])
        ctx.say(f"  stall/{ctx.storage} d2h {k}: {best:.4f}s, {nbytes / best / 1e9:.1f} GB/s")
        yield row(ctx, "stall", "d2h", case=k, seconds=best, gbps=nbytes / best / 1e9, bytes=nbytes,
                  repeats=len(d2h[k]), samples=[round(s, 5) for s in d2h[k]], **where)

    peers = [p for p in PEERS if p in ctx.peers]
    _loop(fresh(base, 0), 3)        # compiles the step
    step_s = _loop(fresh(base, 0), 10)[0] / 10
    warm: dict = {}
    for name in list(peers):        # untimed: each peer's first save sets things up
        try:
            s = _round(ctx, name, base, target, check, 3, 0)
        except bp.Unavailable as e:
            peers.remove(name)
            yield row(ctx, "stall", name, case="", skipped=str(e))
            continue
        warm[name] = s["durable_s"]
    if not peers:
        return
    steps = max(5, min(MAX_STEPS, math.ceil(1.5 * max(warm.values()) / step_s)))
    samples: dict = {name: [] for name in peers}
    for r in range(ctx.repeats):
        for name in (peers if r % 2 == 0 else peers[::-1]):
            samples[name].append(_round(ctx, name, base, target, check, steps, r + 1))
    for name in peers:
        got = samples[name]
        best = {k: min(s[k] for s in got) for k in ("base_s", "loop_s", "blocking_s", "durable_s", "restore_s")}
        yield row(ctx, "stall", name, case=f"{steps} steps", stall_s=best["loop_s"] - best["base_s"],
                  round_stall_s=statistics.median(s["loop_s"] - s["base_s"] for s in got), **best,
                  step_s=step_s, steps=steps, bytes=nbytes, repeats=len(got),
                  correct=all(s["correct"] for s in got),
                  samples=[{k: round(v, 5) if isinstance(v, float) else v for k, v in s.items()} for s in got],
                  **where)


def _round(ctx, name, base, target, check, steps: int, r: int) -> dict:
    """One round of peer `name`: the loop alone and the loop with a save before its first step,
    in this order in odd rounds and the other way round in even ones (the loop's speed drifts
    over a run: on an H200 it got ~10 ms faster per round, which a fixed order would have taken
    off the stall). ``durable_s`` is timed by a thread that waits for the save beside the loop
    (`peer.wait` once the loop has ended would time the loop whenever the loop outlasts the save,
    as it is meant to)."""
    from .bench_workloads import fresh

    def alone():
        gc.collect()
        return _loop(fresh(base, 2 * r + 1), steps)[0]

    base_s = alone() if r % 2 else None
    d = os.path.join(ctx.root, f"{name}-stall-{r}")
    shutil.rmtree(d, ignore_errors=True)
    peer = bp.PEERS[name](d)
    try:
        state = fresh(base, 2 * r + 2)
        expect = jax.block_until_ready(_copy(state[check]))
        saved, got = threading.Event(), {}

        def save(s):
            got["t0"] = time.perf_counter()
            try:
                peer.save(1, s)
            finally:
                saved.set()

        def waiter():
            saved.wait()
            try:
                peer.wait()
                got["durable"] = time.perf_counter()
            except BaseException as e:  # noqa: BLE001 - raised on the main thread below
                got["error"] = e

        w = threading.Thread(target=waiter, name="bench-stall-wait", daemon=True)
        w.start()
        gc.collect()
        try:
            loop_s, blocking_s = _loop(state, steps, before=save)
        finally:
            saved.set()
            w.join()
        del state
        if "error" in got:
            raise got["error"]
        peer.wait()
        durable_s = got["durable"] - got["t0"]
        if ctx.cache == "cold":
            bp.evict(d)
        t1 = time.perf_counter()
        out = peer.restore(1, target)
        restore_s = time.perf_counter() - t1
        ok = bool(jnp.array_equal(out[check], expect))
        del out
    finally:
        peer.close()
        shutil.rmtree(d, ignore_errors=True)
    if base_s is None:
        base_s = alone()
    ctx.say(f"  stall/{ctx.storage} {name} #{r}: {steps} steps alone {base_s:.3f}s, with a save {loop_s:.3f}s "
            f"(stall {loop_s - base_s:+.3f}s, blocking {blocking_s:.4f}s), durable {durable_s:.3f}s, "
            f"restore {restore_s:.3f}s{'' if ok else ' WRONG VALUES'}")
    return dict(base_s=base_s, loop_s=loop_s, blocking_s=blocking_s, durable_s=durable_s, restore_s=restore_s,
                correct=ok)
