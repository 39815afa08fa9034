"""`ckpt-callbacks bench`: this package's save/restore speed and memory, side by side with Orbax,
flax msgpack, np.savez and the raw write+fsync bandwidth of the same directory, on tmpfs and on disk.

Example::

    ckpt-callbacks bench                                   # every workload, full size (minutes)
    ckpt-callbacks bench --workloads big,small --scale 0.25 --repeats 2
    ckpt-callbacks bench --workloads big --scale 0.01 --json > bench.json
    python -m ckpt_callbacks.bench --help                  # the same, without the console script

Who calls what: `ckpt_callbacks.cli` dispatches ``bench ...`` to `main(argv)` (the exit status is
returned). `main` runs, for each workload and storage (``--storage tmpfs,disk``), one child
process (``python -m ckpt_callbacks.bench --child ...``) that sets ``jax_num_cpu_devices=8``
before any device use (but for ``stall``, which measures a save's stall on the accelerator JAX
finds by default, and reports itself skipped where there is none: `bench_stall`) and runs
`bench_workloads.WORKLOADS[name]`; a child per cell keeps one
cell's allocations and caches out of the next one's memory and timings. ``--in-process`` runs
them in this process instead (8 CPU devices are set up here, or the bench re-executes itself in a
subprocess if JAX already started with another device count; ``stall`` then finds no
accelerator). Then the rows are rendered as a
table (or ``--json``), with ratios of this package to each peer and a verdict on every target of
issue #10. Workloads and what limits them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from .bench_report import ratios, render, targets

__all__ = ["main", "targets", "render"]

MiB = 1 << 20
WORKLOAD_NAMES = ("big", "small", "reshard", "memory", "fit", "stall")
PEER_NAMES = ("ckpt_callbacks", "orbax", "flax-msgpack", "np.savez", "raw")
ENGINE = "ckpt_callbacks"


def _csv(choices):
    def parse(text):
        got = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in got if t not in choices]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r}: choose from {','.join(choices)}")
        return got
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt-callbacks bench", description=(
        "Measure blocking time, save-to-durable time, restore time, peak host memory and files of "
        "ckpt_callbacks against Orbax, flax msgpack, np.savez and raw write+fsync, on tmpfs and disk."))
    p.add_argument("--workloads", type=_csv(WORKLOAD_NAMES), default=list(WORKLOAD_NAMES),
                   help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (default: all)")
    p.add_argument("--peers", type=_csv(PEER_NAMES), default=list(PEER_NAMES),
                   help=f"comma-separated subset of {','.join(PEER_NAMES)} (default: all importable); "
                        "on big and small they take turns in this order, reversed every other round")
    p.add_argument("--storage", type=_csv(("tmpfs", "disk")), default=["tmpfs", "disk"],
                   help="where to write: tmpfs,disk (default: both)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="size factor on every workload's bytes (1.0: big = 1 GiB, small = 2,000 leaves)")
    p.add_argument("--repeats", type=int, default=3, help="measured saves per peer; the best is reported")
    p.add_argument("--tmpfs-dir", default="/dev/shm", help="tmpfs directory (default /dev/shm)")
    p.add_argument("--disk-dir", default=None, help="disk directory (default: ./ckpt-bench-tmp under the cwd)")
    p.add_argument("--cache", choices=("cold", "hot"), default="cold",
                   help="cold: evict the checkpoint's pages before each restore (default)")
    p.add_argument("--memory", choices=("recycled", "as-is"), default="recycled",
                   help="recycled: before each timed save and restore, fill and drop 1.25x its bytes of "
                        "page cache of a file in the disk directory, so every peer starts with "
                        "just-freed memory (default); as-is: memory as the turn before left it")
    p.add_argument("--leak-saves", type=int, default=100, help="consecutive saves in the memory workload")
    p.add_argument("--fit-epochs", type=int, default=5, help="epochs per fit in the fit workload")
    p.add_argument("--fit-repeats", type=int, default=7,
                   help="rounds of the fit workload (each fits once per callback; the best is reported)")
    p.add_argument("--slow-s", type=float, default=30.0, help="do not repeat a save slower than this")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.add_argument("--output", help="also write the JSON results to this file")
    p.add_argument("--in-process", action="store_true", help="run every workload in this process")
    p.add_argument("--cell-timeout", type=float, default=3600.0,
                   help="seconds a workload may take on one storage before its child is killed")
    p.add_argument("--child", nargs=4, metavar=("WORKLOAD", "STORAGE", "DIR", "OUT"), help=argparse.SUPPRESS)
    return p


# -- devices -----------------------------------------------------------------------------------
def _ensure_devices() -> bool:
    """Set 8 CPU devices if JAX has not started; True when this process has them."""
    import jax
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    return jax.default_backend() == "cpu" and len(jax.devices()) == 8


# -- running -----------------------------------------------------------------------------------
def _storage_dirs(args) -> dict:
    disk = args.disk_dir or os.path.join(os.getcwd(), "ckpt-bench-tmp")
    return {"tmpfs": args.tmpfs_dir, "disk": disk}


def _recycle_file(args) -> str | None:
    """The page-cache file of ``--memory recycled`` (on the disk directory, whichever storage is
    measured: freed tmpfs pages are not what a save or restore reuses); None for ``as-is``."""
    if args.memory != "recycled":
        return None
    return os.path.join(_storage_dirs(args)["disk"], RECYCLE_NAME)


def _context(args, root: str, storage: str):
    from .bench_workloads import Context
    return Context(root=root, storage=storage, scale=args.scale, repeats=max(1, args.repeats),
                   peers=tuple(args.peers), cache=args.cache, slow_s=args.slow_s,
                   leak_saves=args.leak_saves, fit_epochs=args.fit_epochs,
                   fit_repeats=max(1, args.fit_repeats), recycle=_recycle_file(args))


def _run_child(args) -> int:
    workload, storage, root, out = args.child
    if workload != "stall" and not _ensure_devices():
        sys.stderr.write("ckpt-callbacks bench: the child needs 8 CPU devices (JAX started already)\n")
        return 2
    from .bench_workloads import WORKLOADS
    with open(out, "w", encoding="utf-8") as f:   # one JSON row per line, as each is measured
        for row in WORKLOADS[workload](_context(args, root, storage)):
            f.write(json.dumps(row) + "\n")
            f.flush()
    return 0


def _child_env(workload: str) -> dict:
    """The environment of a cell's child process (``stall``: JAX's default platforms)."""
    env = dict(os.environ) if workload == "stall" else dict(os.environ, JAX_PLATFORMS="cpu")
    if workload != "fit":
        # a fixed mmap threshold: glibc otherwise raises it after large frees and keeps freed
        # buffers in the heap, so a later save's RSS peak would hide inside an earlier one's.
        # Not for `fit`, which measures no memory: there every large buffer of every training
        # step would be a fresh mapping, and a fit without a callback 1.5x slower than in a
        # user's process (which the overhead would then be measured against)
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    return env


def _cell(args, argv, workload: str, storage: str, base: str) -> list:
    root = tempfile.mkdtemp(prefix=f"ckpt-bench-{storage}-", dir=base)
    try:
        if args.in_process:
            from .bench_workloads import WORKLOADS
            return list(WORKLOADS[workload](_context(args, root, storage)))
        out = os.path.join(root, "rows.jsonl")
        cmd = [sys.executable, "-m", "ckpt_callbacks.bench", *argv, "--child", workload, storage, root, out]
        try:
            rc = subprocess.call(cmd, env=_child_env(workload), timeout=args.cell_timeout)
            why = f"the bench child process failed (exit status {rc}); see stderr"
        except subprocess.TimeoutExpired:
            rc, why = None, (f"did not finish within --cell-timeout {args.cell_timeout:g} s (a hang?); "
                             f"rows measured before are kept")
        rows = []
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                rows = [json.loads(ln) for ln in f if ln.strip()]
        if rc != 0:
            rows.append({"workload": workload, "storage": storage, "peer": ENGINE, "case": "rest", "skipped": why})
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def machine(dirs: dict) -> dict:
    import psutil
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    for storage, d in dirs.items():
        try:
            parts = [p for p in psutil.disk_partitions(all=True) if os.path.abspath(d).startswith(p.mountpoint)]
            mp = max(parts, key=lambda p: len(p.mountpoint))
            info[f"{storage}_fs"] = f"{mp.fstype} {mp.device} at {mp.mountpoint}"
        except ValueError:
            pass
    here = os.path.dirname(os.path.abspath(__file__))
    try:  # the engine measured: commit, and whether its files differ from it
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10).stdout.split()
        info["engine"] = f"{rev}{' + uncommitted changes' if dirty else ''}" if rev else "not a git checkout"
    except (OSError, subprocess.SubprocessError):
        info["engine"] = "not a git checkout"
    info["engine_path"] = here
    from importlib import metadata
    for pkg in ("jax", "tensorstore", "orbax-checkpoint", "flax", "keras", "numpy"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


RECYCLE_NAME = "ckpt-bench-recycle.bin"
REPORT_WAIT_S = 5.0   # a guest reports freed memory to the host ~2 s after it is freed


def fresh_memory(nbytes: int = 256 * MiB) -> dict:
    """Milliseconds per MiB for this process to first write the pages of a new anonymous mapping
    of `nbytes` (``fresh_memory_ms_per_mib``), and for a second mapping made right after the first
    is unmapped (``reused_memory_ms_per_mib``: pages the kernel freed a moment ago).

    Why: every restore fills new buffers, a tmpfs save new tmpfs pages and a first save new staging
    buffers, and on a VM whose host takes back the memory its guest frees (a balloon with free page
    reporting, as on this project's EPYC test VM) the first touch of such memory costs a host-side
    fault per page: from ~0.5 to over 2 ms per MiB on that VM from hour to hour, against ~0.4 ms
    there for pages freed a moment before (the guest kernel's own fault and zeroing). The two
    numbers put each run's memory-bound timings in context; `main` measures them before the first
    workload (whose child process starts with 256 MiB unmapped a moment earlier) and again after
    the last, once `REPORT_WAIT_S` have passed (the freed memory of the last child is otherwise
    what the measurement gets)."""
    import mmap
    import numpy as np
    out = {}
    for key in ("fresh_memory_ms_per_mib", "reused_memory_ms_per_mib"):
        m = (mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if hasattr(mmap, "MAP_ANONYMOUS")
             else mmap.mmap(-1, nbytes))
        pages = np.frombuffer(m, np.uint8)
        t0 = time.perf_counter()
        pages[::mmap.PAGESIZE] = 1   # one write per page: each page is faulted in and zeroed
        out[key] = round((time.perf_counter() - t0) * 1e3 / (nbytes / MiB), 3)
        del pages
        m.close()
    return out


def main(argv=None) -> int:
    """Run the benchmark; see the module docstring. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.child:
        return _run_child(args)
    if args.in_process and not _ensure_devices():
        # JAX already started here with another device count: run the whole bench in a fresh process
        return subprocess.call([sys.executable, "-m", "ckpt_callbacks.bench", *argv],
                               env=dict(os.environ, JAX_PLATFORMS="cpu"))
    dirs = {s: d for s, d in _storage_dirs(args).items() if s in args.storage}
    recycle = _recycle_file(args)
    made = []
    for d in {*dirs.values(), *([os.path.dirname(recycle)] if recycle else [])}:
        if not os.path.isdir(d):
            os.makedirs(d)
            made.append(d)
    memory = [fresh_memory()]   # before and after the workloads: see `fresh_memory`
    t0 = time.time()
    rows = []
    try:
        for workload in args.workloads:
            for storage, base in dirs.items():
                print(f"bench: {workload} on {storage} ({base}) ...", file=sys.stderr, flush=True)
                rows += _cell(args, argv, workload, storage, base)
    finally:
        if recycle and os.path.exists(recycle):
            os.remove(recycle)
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
    time.sleep(REPORT_WAIT_S)
    memory.append(fresh_memory())
    result = {"command": "ckpt-callbacks bench " + " ".join(argv),
              "machine": {**machine(dirs), **{k: [m[k] for m in memory] for k in memory[0]}},
              "config": {k: v for k, v in vars(args).items() if k not in ("child", "json", "output")},
              "elapsed_s": round(time.time() - t0, 1), "rows": rows}
    result["ratios"] = ratios(rows)
    result["targets"] = targets(rows, args.scale)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    sys.stdout.write(json.dumps(result, indent=1) + "\n" if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
