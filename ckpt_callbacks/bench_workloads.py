"""The workloads of `ckpt-callbacks bench`: each yields result rows (dicts) for one storage directory.

Example (what `ckpt_callbacks.bench` runs, in a process with 8 CPU devices)::

    from ckpt_callbacks import bench_workloads as bw
    ctx = bw.Context(root="/dev/shm/b", storage="tmpfs", scale=0.01, repeats=1)
    rows = list(bw.WORKLOADS["big"](ctx))  # [{"workload": "big", "peer": "orbax", "blocking_s": ...}, ...]

Who calls what: `bench.main` (or its child process, one per workload and storage) builds a `Context`
and iterates one workload generator on the main thread (a row is yielded as soon as it is
measured, so a hang later loses no earlier row); it creates and removes directories under
``ctx.root`` only. Every measured save gets fresh arrays (``base + k`` under jit), because
`np.asarray` caches a host copy on a jax.Array and re-saving the same arrays measures nothing
(DESIGN.md §3.1). Timings: ``blocking_s`` = time inside ``save``; ``durable_s`` = from the call until
``wait`` returns (bytes fsynced and committed); ``restore_s`` = restore onto the target's shardings
until ready, after the files were evicted from the page cache (``cache="cold"``; no-op on tmpfs).
Per column the best of ``repeats`` is reported (the machine is shared: the minimum is the least
disturbed); the peers of big and small take turns, round by round, since the targets are their
ratios; ``peak_rss`` is the highest host RSS above the live state seen during save+wait. Right
before each timer starts, `Context.settle` recycles page cache (``--memory recycled``, when
``ctx.recycle`` names a file), the same for every peer: `bench_peers.recycle_page_cache` says why.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import shutil
import sys
import time

import jax
import numpy as np

from . import bench_peers as bp

__all__ = ["Context", "WORKLOADS"]

MiB = 1 << 20


@dataclasses.dataclass
class Context:
    root: str                      # an empty directory on the storage under test
    storage: str                   # "tmpfs" | "disk"
    scale: float = 1.0
    repeats: int = 3
    peers: tuple = ("ckpt_callbacks", "orbax", "flax-msgpack", "np.savez", "raw")
    cache: str = "cold"
    slow_s: float = 30.0           # a peer whose save takes longer is not repeated
    leak_saves: int = 100
    fit_epochs: int = 5
    fit_repeats: int = 7           # a fit is ~2.5 s and its noise is a few %: more rounds than saves
    log: object = None
    recycle: str | None = None     # a file on a disk: `bench_peers.recycle_page_cache` before each
                                   # timed save and restore (None: memory as the turn before left it)

    def say(self, msg: str) -> None:
        (self.log or (lambda m: print(m, file=sys.stderr, flush=True)))(msg)

    def settle(self, nbytes: int) -> None:
        """Called right before each timer starts (every peer alike): recycle page cache for a
        save or restore of `nbytes` (1.25x: a peer's staging copies need memory too)."""
        if self.recycle:
            bp.recycle_page_cache(self.recycle, int(nbytes * 1.25))


# -- trees -------------------------------------------------------------------------------------
def _mesh(shape, names=("x", "y")):
    return jax.make_mesh(shape, names, devices=jax.devices()[:math.prod(shape)])


def _side(scale: float, full: int = 4096) -> int:
    return max(8, int(round(full * math.sqrt(scale) / 8)) * 8)


def big_tree(scale: float, count: int = 16, full: int = 4096, mesh=None):
    """`count` float32 n x n arrays sharded over a 4x2 mesh, or `mesh` (axes x, y) (16 x 4096^2 =
    1 GiB at scale 1)."""
    n = _side(scale, full)
    sharding = jax.sharding.NamedSharding(mesh or _mesh((4, 2)), jax.sharding.PartitionSpec("x", "y"))
    gen = jax.jit(lambda k: jax.random.normal(k, (n, n), np.float32), out_shardings=sharding)
    key = jax.random.key(0)
    return jax.block_until_ready({f"w{i:02d}": gen(jax.random.fold_in(key, i)) for i in range(count)})


def small_tree(scale: float, count: int = 2000):
    """`count` (scaled) replicated float32 leaves of 4-256 KiB each (~0.25 GiB at scale 1)."""
    count = max(8, int(round(count * scale)))
    rng = np.random.default_rng(1)
    sharding = jax.sharding.NamedSharding(_mesh((4, 2)), jax.sharding.PartitionSpec())
    sizes = rng.integers(1024, 64 * 1024 + 1, count)        # float32 elements: 4 KiB .. 256 KiB
    return jax.block_until_ready({f"s{i:04d}": jax.device_put(rng.standard_normal(int(k), np.float32), sharding)
                                  for i, k in enumerate(sizes)})


_bump = jax.jit(lambda t, k: jax.tree.map(lambda a: a + k, t))


def fresh(base, k: int):
    """New arrays (same shardings) never seen by np.asarray: ``base + k``."""
    return jax.block_until_ready(_bump(base, np.float32(k)))


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def abstract(tree, sharding=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding), tree)


def needed_bytes(target) -> int:
    """Unique bytes of the target's addressable shards (what a restore must read at least)."""
    total = 0
    for t in jax.tree.leaves(target):
        boxes = {tuple((s.start or 0, s.stop if s.stop is not None else d) for s, d in zip(idx, t.shape))
                 for idx in t.sharding.addressable_devices_indices_map(t.shape).values()}
        total += sum(math.prod(b - a for a, b in box) for box in boxes) * np.dtype(t.dtype).itemsize
    return total


# -- measuring ---------------------------------------------------------------------------------
def _row(ctx, workload, peer, **kw) -> dict:
    return {"workload": workload, "storage": ctx.storage, "peer": peer, **kw}


def _best(samples: list, nbytes: int) -> dict:
    keys = ("blocking_s", "durable_s", "restore_s")
    out = {k: min(s[k] for s in samples) for k in keys if all(s.get(k) is not None for s in samples)}
    out["peak_rss"] = max(s["peak_rss"] for s in samples)
    out.update(files=samples[-1]["files"], disk_bytes=samples[-1]["disk_bytes"], bytes=nbytes,
               repeats=len(samples), correct=all(s.get("correct", True) for s in samples),
               samples=[{k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()} for s in samples])
    return out


def measure(ctx, workload: str, name: str, base, target, *, options=None, case: str = "") -> dict:
    """Save fresh arrays with peer `name` in a new directory, wait, restore (cold); best of repeats."""
    return next(_in_turns(ctx, workload, base, target, (name,), options, case))


def _sample(ctx, workload, name, base, target, r, options=None, case="") -> dict:
    """One save + wait + cold restore by peer `name` in a new directory (removed after)."""
    check = sorted(base)[0]
    d = os.path.join(ctx.root, f"{name}-{r}")
    shutil.rmtree(d, ignore_errors=True)
    peer = bp.PEERS[name](d, **(options or {}))
    try:
        tree = fresh(base, r + 1)
        gc.collect()
        ctx.settle(tree_bytes(base))
        with bp.RssPeak() as mem:
            t0 = time.perf_counter()
            peer.save(1, tree)
            t1 = time.perf_counter()
            peer.wait()
            t2 = time.perf_counter()
        expect = np.asarray(tree[check]).copy()
        del tree
        files, size = bp.count_files(peer.path(1))
        if ctx.cache == "cold":
            bp.evict(d)
        gc.collect()
        ctx.settle(tree_bytes(base))
        t3 = time.perf_counter()
        out = peer.restore(1, target)
        t4 = time.perf_counter()
        ok = bool(np.array_equal(np.asarray(out[check]), expect))
        del out
    finally:
        peer.close()
        shutil.rmtree(d, ignore_errors=True)
    ctx.say(f"  {workload}/{ctx.storage} {name}{' ' + case if case else ''} #{r + 1}: blocking "
            f"{t1 - t0:.3f}s durable {t2 - t0:.3f}s restore {t4 - t3:.3f}s peak +{mem.peak / MiB:.0f} MiB")
    return dict(blocking_s=t1 - t0, durable_s=t2 - t0, restore_s=t4 - t3, peak_rss=mem.peak,
                files=files, disk_bytes=size, correct=ok)


def _raw_sample(ctx, workload: str, nbytes: int, r: int) -> dict:
    """Plain write+fsync of the same byte count in 64 MiB chunks to 4 files; read back cold."""
    d = os.path.join(ctx.root, f"raw-{r}")
    shutil.rmtree(d, ignore_errors=True)
    bp._random_buffer(min(bp.RAW_CHUNK, -(-nbytes // 4)))
    try:
        ctx.settle(nbytes)
        with bp.RssPeak() as mem:
            t0 = time.perf_counter()
            paths = bp.raw_write(d, nbytes)
            t1 = time.perf_counter()
        files, size = bp.count_files(d)
        if ctx.cache == "cold":
            bp.evict(d)
        ctx.settle(nbytes)
        t2 = time.perf_counter()
        got = bp.raw_read(paths)
        t3 = time.perf_counter()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ctx.say(f"  {workload}/{ctx.storage} raw #{r + 1}: write+fsync {t1 - t0:.3f}s read {t3 - t2:.3f}s")
    return dict(blocking_s=t1 - t0, durable_s=t1 - t0, restore_s=t3 - t2, peak_rss=mem.peak,
                files=files, disk_bytes=size, correct=got == nbytes)


def _in_turns(ctx, workload, base, target, peers, options=None, case=""):
    """Every peer saves and restores once per round, in the order of `peers` on even rounds
    and in reverse on odd ones, so that a slow stretch of this shared machine (its disk, or the
    price of fresh memory, which moves from hour to hour: docs/benchmarks.md) hits all of them
    alike: the targets are ratios of ckpt_callbacks to raw (disk) and to Orbax (tmpfs), which
    swung from run to run while each peer ran its repeats minutes apart from the others. A peer
    whose save took over ``ctx.slow_s`` is not repeated; each peer's row is yielded as soon as it
    has its last sample (a hang later loses no earlier row)."""
    nbytes = tree_bytes(base)
    samples: dict = {name: [] for name in peers}
    done: set = set()
    for r in range(ctx.repeats):
        for name in (peers if r % 2 == 0 else peers[::-1]):
            if name in done:
                continue
            try:
                s = _raw_sample(ctx, workload, nbytes, r) if name == "raw" else \
                    _sample(ctx, workload, name, base, target, r, options, case)
            except bp.Unavailable as e:
                done.add(name)
                yield _row(ctx, workload, name, case=case, skipped=str(e))
                continue
            samples[name].append(s)
            if r == ctx.repeats - 1 or s["durable_s"] > ctx.slow_s:
                done.add(name)
                yield _row(ctx, workload, name, case="write+fsync" if name == "raw" else case,
                           **_best(samples[name], nbytes))


# -- workloads ---------------------------------------------------------------------------------
def run_big(ctx: Context):
    base = big_tree(ctx.scale)
    yield from _in_turns(ctx, "big", base, abstract(base), tuple(ctx.peers))


def run_small(ctx: Context):
    base = small_tree(ctx.scale)
    yield from _in_turns(ctx, "small", base, abstract(base), tuple(ctx.peers))


def run_reshard(ctx: Context):
    """Save big once per peer (4x2 mesh), then restore it onto 4x2, 2x4 and one device (cold), the
    three targets in turn `repeats` times after one untimed restore."""
    base = big_tree(ctx.scale)
    P = jax.sharding.PartitionSpec
    targets = {"4x2 (same)": abstract(base),
               "2x4": abstract(base, jax.sharding.NamedSharding(_mesh((2, 4)), P("x", "y"))),
               "1 device": abstract(base, jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    check = sorted(base)[0]
    for name in [p for p in ctx.peers if p in ("ckpt_callbacks", "orbax")]:
        d = os.path.join(ctx.root, f"{name}-reshard")
        shutil.rmtree(d, ignore_errors=True)
        try:
            peer = bp.PEERS[name](d)
        except bp.Unavailable as e:
            yield _row(ctx, "reshard", name, case="", skipped=str(e))
            continue
        try:
            tree = fresh(base, 1)
            peer.save(1, tree)
            peer.wait()
            expect = np.asarray(tree[check]).copy()
            del tree
            files, size = bp.count_files(peer.path(1))
            # untimed: a fresh process's first large allocations cost more than any later ones
            # (first touch of memory the VM has not backed yet); then the targets take turns, so
            # that no target is measured in a better or worse state of the process than another
            warm = peer.restore(1, targets["4x2 (same)"])
            del warm
            samples: dict = {case: [] for case in targets}
            for r in range(ctx.repeats):
                for case, target in targets.items():
                    if ctx.cache == "cold":
                        bp.evict(d)
                    gc.collect()
                    ctx.settle(tree_bytes(base))
                    b0, s0, t0 = bp.bytes_read(), bp.ts_bytes_read(), time.perf_counter()
                    out = peer.restore(1, target)
                    t1, b1, s1 = time.perf_counter(), bp.bytes_read(), bp.ts_bytes_read()
                    ok = bool(np.array_equal(np.asarray(out[check]), expect))
                    del out
                    samples[case].append(dict(restore_s=t1 - t0, bytes_read=b1 - b0, ts_bytes_read=s1 - s0,
                                              peak_rss=0, files=files, disk_bytes=size, correct=ok))
                    ctx.say(f"  reshard/{ctx.storage} {name} -> {case} #{r + 1}: {t1 - t0:.3f}s, "
                            f"read {(b1 - b0) / MiB:.0f} MiB")
            for case, target in targets.items():
                best = _best(samples[case], tree_bytes(base))
                best.pop("peak_rss")
                yield _row(ctx, "reshard", name, case=case, bytes_read=min(s["bytes_read"] for s in samples[case]),
                           ts_bytes_read=min(s["ts_bytes_read"] for s in samples[case]),
                           bytes_needed=needed_bytes(target), **best)
        finally:
            peer.close()
            shutil.rmtree(d, ignore_errors=True)


def run_memory(ctx: Context):
    """`leak_saves` consecutive saves of a 16x smaller tree than big (fresh arrays each,
    KeepLast(2)): RSS growth; then the peak host RSS of one big save without a staging budget
    and with a budget of 1/4 of its bytes (last: a save that hangs on the budget loses no row)."""
    from .retention import KeepLast
    small = big_tree(ctx.scale, full=1024)
    import psutil
    proc = psutil.Process()
    d = os.path.join(ctx.root, "leak")
    shutil.rmtree(d, ignore_errors=True)
    peer = bp.Engine(d, retention=KeepLast(2))
    rss, durable = [], []
    try:
        for step in range(1, ctx.leak_saves + 1):
            tree = fresh(small, step)
            t0 = time.perf_counter()
            peer.save(step, tree)
            del tree
            peer.wait()
            durable.append(time.perf_counter() - t0)
            rss.append(proc.memory_info().rss)
    finally:
        peer.close()
        shutil.rmtree(d, ignore_errors=True)
    n = len(rss)
    w = max(1, n // 10)
    early = float(np.median(rss[min(w, n - w):min(2 * w, n)] or rss[:w]))
    late = float(np.median(rss[-w:]))
    slope = float(np.polyfit(np.arange(n - w), np.asarray(rss[w:], float), 1)[0]) if n - w >= 2 else 0.0
    ctx.say(f"  memory/{ctx.storage} {n} saves of {tree_bytes(small) / MiB:.0f} MiB: RSS {early / MiB:.0f} -> "
            f"{late / MiB:.0f} MiB, slope {slope / 1024:.1f} KiB/save")
    yield _row(ctx, "memory", "ckpt_callbacks", case=f"{n} saves", bytes=tree_bytes(small),
               durable_s=float(np.median(durable)), growth_bytes=late - early, slope_bytes_per_save=slope,
               rss_first=rss[0], rss_last=rss[-1], repeats=n)
    del small
    gc.collect()
    base = big_tree(ctx.scale)
    budget = max(MiB, tree_bytes(base) // 4)
    yield measure(ctx, "memory", "ckpt_callbacks", base, abstract(base), case="no budget")
    row = measure(ctx, "memory", "ckpt_callbacks", base, abstract(base), case=f"budget {budget // MiB} MiB",
                  options={"max_staging_bytes": budget})
    yield dict(row, budget=budget)


def run_fit(ctx: Context):
    from . import bench_fit
    yield from bench_fit.run(ctx, _row)


def run_stall(ctx: Context):
    from . import bench_stall
    yield from bench_stall.run(ctx, _row)


WORKLOADS = {"big": run_big, "small": run_small, "reshard": run_reshard, "memory": run_memory, "fit": run_fit,
             "stall": run_stall}
