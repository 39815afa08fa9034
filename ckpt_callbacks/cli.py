"""`ckpt-callbacks`: look at, verify, prune and picture checkpoint directories from a shell.

Example::

    ckpt-callbacks ls /tmp/run                      # steps, committed or partial, size, metrics, best
    ckpt-callbacks inspect /tmp/run --step 200      # key paths, shapes, dtypes, shardings, bytes
    ckpt-callbacks verify s3://bucket/run           # reads every leaf, checks every checksum
    ckpt-callbacks gc /tmp/run --keep-last 3 --keep-best val_loss:min:2 --dry-run
    ckpt-callbacks timeline /tmp/run -o timeline.html
    ckpt-callbacks bench --help

Who calls what: a person or a script, on any machine that can reach the directory (local path,
``file://``, ``s3://``, ``gs://``; object stores take the usual environment, see docs/storage.md).
`main(argv)` parses, then runs one subcommand in this process. It never uses an accelerator: it
pins JAX to the CPU and reads through storage/format/restore.leaf_reader without creating device
arrays. `gc` takes the directory's writer lock (local directories) so it never races a live
trainer (`ckpt_callbacks.cli_gc`); every other subcommand only reads. Exit status: 0 ok, 1 damage found (`verify`) or an
error, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

__all__ = ["main", "build_parser", "read_manifests", "leftover_records"]


def _strict(x):
    """`x` with non-finite floats as the strings "NaN", "Infinity", "-Infinity" (JSON has no such
    numbers; a NaN metric is a legitimate one: the worst)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else "Infinity" if x > 0 else "-Infinity"
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def _json(obj, out) -> None:
    json.dump(_strict(obj), out, indent=1, allow_nan=False)


def _human(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _metric_text(metrics: dict) -> str:
    """Numbers as numbers; a str metric (stored, never ranked) quoted, so it never reads as one."""
    return " ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v!r}" if isinstance(v, (str, bytes))
                    else f"{k}={v}" for k, v in sorted(metrics.items()))


def _parse_best(text: str, with_n: bool):
    parts = text.split(":")
    if len(parts) not in ((2, 3) if with_n else (2,)) or not parts[0] or parts[1] not in ("min", "max"):
        form = "METRIC:min|max[:N]" if with_n else "METRIC:min|max"
        raise argparse.ArgumentTypeError(f"expected {form}, e.g. val_loss:min, got {text!r}")
    n = 1
    if len(parts) == 3:
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise argparse.ArgumentTypeError(f"N in {text!r} must be a positive int")
        n = int(parts[2])
    return {"metric": parts[0], "mode": parts[1], "n": n}


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return n


def _positive_seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = 0.0
    if not 0 < s < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return s


def _steps_list(text: str) -> list[int]:
    parts = text.split(",")
    try:
        if not all(p.strip() for p in parts):   # "1,,2", "1,": a typo, not two steps
            raise ValueError(text)
        steps = [int(x) for p in parts for x in p.split()]
        if any(s < 0 for s in steps):
            raise ValueError(text)
        return steps
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected non-negative steps like 100,200, got {text!r}") from None


# -- reading helpers -------------------------------------------------------------------------
def read_manifests(store, steps):
    """{step: manifest or the CheckpointError that reading it raised}, in the order of `steps`; a
    step deleted meanwhile (a live trainer's retention) is left out, not shown as damaged."""
    from .errors import CheckpointError, StorageUnavailableError
    from .restore import read_manifest
    out = {}
    for s in steps:
        try:
            out[s] = read_manifest(store, s)
        except StorageUnavailableError:
            raise   # says nothing about the step: never shown as damaged
        except CheckpointError as e:
            out[s] = e
    if any(not isinstance(m, dict) for m in out.values()):
        listed = set(store.committed_steps())
        out = {s: m for s, m in out.items() if isinstance(m, dict) or s in listed}
    return out


def _pick_step(store, step):
    from .errors import CheckpointNotFoundError
    steps = store.committed_steps()
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint in {store.url}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointNotFoundError(f"step {step} is not committed in {store.url}; committed: {steps}")
    return step


def _best(manifests: dict, best_arg):
    """(policy dict, where it came from, best step or None)."""
    from .retention import KeepBest, KeepBestBeyond, StepInfo
    src = "--best"
    spec = best_arg
    if spec is None:
        for m in reversed([m for m in manifests.values() if isinstance(m, dict)]):
            kb = (m.get("extra") or {}).get("keep_best")
            if isinstance(kb, dict) and kb.get("metric"):
                spec, src = kb, "the run's KeepBest"
                break
    if spec is None:
        return None, None, None
    infos = [StepInfo(s, 0.0, m.get("metrics") or {}) for s, m in manifests.items() if isinstance(m, dict)]
    args = (spec["metric"], spec.get("mode", "min"), spec.get("n", 1) or 1)
    th = spec.get("threshold")   # a step must beat it to rank, as the run ranked
    policy = KeepBestBeyond(*args, th) if isinstance(th, (int, float)) else KeepBest(*args)
    ranked = policy.rank(infos)
    return spec, src, (ranked[0] if ranked else None)


# -- ls --------------------------------------------------------------------------------------
def cmd_ls(args, store, out) -> int:
    ms = read_manifests(store, store.committed_steps())
    steps = list(ms)
    spec, src, best = _best(ms, args.best)
    rows = []
    for s in steps:
        m = ms[s]
        ok = isinstance(m, dict)
        rows.append({"step": s, "status": "committed" if ok else "damaged",
                     "time": (m.get("time") if ok else None), "bytes": (m.get("bytes") if ok else None),
                     "size": store.size(s), "metrics": (m.get("metrics") or {}) if ok else {},
                     "best": s == best, "error": None if ok else str(m)})
    partial = leftover_records(store, steps)
    if args.json:
        _json({"directory": store.url, "steps": rows, "partial": partial,
               "best": {"step": best, **spec, "source": src} if spec else None}, out)
        out.write("\n")
        return 0
    n_back = sum(p["status"] == "recoverable" for p in partial)
    n_stale = sum(p["status"] == "stale record" for p in partial)
    head = f"{store.url}: {len(steps)} committed, {len(partial) - n_back - n_stale} partial" + (
        f", {n_back} recoverable" if n_back else "") + (f", {n_stale} stale record(s)" if n_stale else "")
    if spec:
        head += (f"; best by {spec['metric']} ({spec.get('mode', 'min')}, from {src}): "
                 f"{best if best is not None else 'none reported the metric'}")
    out.write(head + "\n")
    out.write(f"{'STEP':>10}  {'STATUS':<10} {'SAVED':<19}  {'DATA':>9} {'ON DISK':>9}  METRICS\n")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if r["time"] else "-"
        tail = _metric_text(r["metrics"]) + ("  * best" if r["best"] else "")
        if r["error"]:
            tail = f"cannot read manifest: {r['error'][:200]}"
        out.write(f"{r['step']:>10}  {r['status']:<10} {when:<19}  {_human(r['bytes']):>9} "
                  f"{_human(r['size']):>9}  {tail}\n")
    for p in partial:
        if p["status"] == "recoverable":
            out.write(f"{p['step']:>10}  recoverable {p['name']}  (the step itself: its forced replacement was "
                      f"interrupted; put back when a manager or `gc` starts)\n")
            continue
        if p["status"] == "stale record":
            out.write(f"{p['step']:>10}  stale      {p['name']}  (the step is committed; only the record of the "
                      f"interrupted save that wrote it is left: dropped, not the step, when a manager starts or "
                      f"by `gc --remove-partial`)\n")
            continue
        kind = _hidden_kind(p["name"])
        what = ("a step deleted by retention: its files are being removed, kept by a running trainer for its "
                "next save to write over, or left by an interrupted removal; never restored" if kind == "del" else
                f"the previous copy of step {p['step']}, which a forced save replaced "
                f"(save(force=True)); never restored" if kind == "old" else
                "staging of a save that is running or was interrupted")
        out.write(f"{'':>10}  partial    {p['name']}  ({what}; removed when a manager starts, or by "
                  f"`gc --remove-partial`)\n")
    return 0


def _hidden_kind(name: str) -> str | None:
    """"tmp" (staging), "del" (a deleted step) or "old" of a local leftover name; None otherwise."""
    from . import format as fmt
    m = fmt.STAGING_RE.match(name)
    return m.group(2) if m else None


def leftover_records(store, steps) -> list[dict]:
    """`store.leftovers()` as `ls` lists them, each ``{"name", "status", "step"}``: "partial" (an
    unfinished save's data, or a deleted or superseded copy of a step), "recoverable"
    (a step left only as the copy its interrupted forced replacement moved aside), or "stale
    record" (object stores: a committed step whose save died before dropping its ``pending/``
    record; `remove` drops only the record)."""
    from . import format as fmt
    back, committed = store.recoverable(), set(steps)
    out = []
    for n in store.leftovers():
        if n in back:
            out.append({"name": n, "status": "recoverable", "step": back[n]})
        elif (step := fmt.parse_step_name(n)) in committed:
            out.append({"name": n, "status": "stale record", "step": step})
        else:   # the step it was a save or a deletion of
            hidden = fmt.STAGING_RE.match(n)
            out.append({"name": n, "status": "partial",
                        "step": int(hidden.group(1)) if hidden else fmt.parse_step_name(n)})
    return out


# -- inspect ---------------------------------------------------------------------------------
def _sharding_text(sd) -> str:
    if not isinstance(sd, dict):
        return ""
    if sd.get("type") == "NamedSharding":
        mesh = ",".join(f"{k}={v}" for k, v in (sd.get("mesh") or {}).items())
        spec = ", ".join("None" if p is None else (",".join(p) if isinstance(p, list) else str(p))
                         for p in sd.get("spec") or [])
        return f"NamedSharding(mesh[{mesh}], P({spec}))"
    return str(sd.get("type", ""))


def _leaf_text(rec) -> tuple[str, int]:
    import numpy as np
    from . import format as fmt
    k = rec["k"]
    if k == "none":
        return "None", 0
    if k == "py":
        v = rec.get("v")
        text = repr(v) if not isinstance(v, (bytes, str)) or len(v) <= 40 else repr(v[:40]) + "..."
        return f"{type(v).__name__} = {text}", 0
    nbytes = math.prod(rec["sh"]) * np.dtype(fmt.logical_dtype(rec["dt"])).itemsize
    dt, shape = rec["dt"], rec["sh"]
    if rec.get("prng"):   # stored as its key data: show the key array's own shape
        dt, shape = f"key<{rec['prng']}>", shape[:len(shape) - len(rec.get("kshape") or [])]
    where = f"zarr {rec['z']} chunks {rec['ch']}" if k == "array" else f"packed in {rec.get('b')}"
    shard = _sharding_text(rec.get("sd"))
    return f"{dt}{shape}  {_human(nbytes)}  {shard + '  ' if shard else ''}{where}", nbytes


def _leaf_json(rec) -> dict:
    """What `inspect --json` says of a leaf: as the text output, field by field."""
    from . import treepath
    d = {"path": treepath.keystr(tuple(map(tuple, rec["p"]))), "kind": rec["k"], "dtype": rec.get("dt"),
         "shape": rec.get("sh"), "sharding": rec.get("sd"), "bytes": _leaf_text(rec)[1]}
    if rec["k"] == "py":
        v = rec.get("v")
        d["type"] = type(v).__name__
        d["value"] = v.hex() if isinstance(v, bytes) else v   # bytes as hex
    if rec.get("prng"):   # dtype/shape are the key data's
        d["prng"] = rec["prng"]
        d["key_shape"] = rec["sh"][:len(rec["sh"]) - len(rec.get("kshape") or [])]
    if rec["k"] == "array":
        d.update(file=rec.get("z"), chunks=rec.get("ch"))
    elif rec["k"] == "packed":
        d["file"] = rec.get("b")
    return d


def cmd_inspect(args, store, out) -> int:
    from . import treepath
    from .restore import read_manifest
    step = _pick_step(store, args.step)
    m = read_manifest(store, step)
    recs = m["leaves"]
    if args.json:
        _json({"step": step, "time": m.get("time"), "bytes": m.get("bytes"), "metrics": m.get("metrics"),
               "process_count": m.get("process_count"), "host_state": sorted(m.get("host") or {}),
               "leaves": [_leaf_json(r) for r in recs]}, out)
        out.write("\n")
        return 0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("time", 0)))
    out.write(f"{store.url} step {step}: saved {when} by {m.get('process_count', 1)} process(es), "
              f"{len(recs)} leaves, {_human(m.get('bytes', 0))}\n")
    if m.get("metrics"):
        out.write(f"metrics: {_metric_text(m['metrics'])}\n")
    if m.get("host"):
        out.write(f"host state: {', '.join(f'process {p}' for p in sorted(m['host']))}\n")

    def walk(node, label, depth):
        pad = "  " * depth
        if "l" in node:
            text, _ = _leaf_text(recs[node["l"]])
            out.write(f"{pad}{label}: {text}\n")
            return
        kind = node["t"] + (f" {node['n']}" if node.get("n") else "")
        out.write(f"{pad}{label} ({kind}, {len(node['c'])})\n" if label else f"{pad}<root> ({kind})\n")
        for e, child in node["c"]:
            walk(child, treepath.keystr((tuple(e),)), depth + 1)

    walk(m["tree"], "", 0)
    return 0


# -- verify ----------------------------------------------------------------------------------
def cmd_verify(args, store, out) -> int:
    from .errors import CheckpointError, CheckpointNotFoundError, StorageUnavailableError
    from .restore import read_manifest
    from .verify import Progress, problem_text, verify_step
    steps = store.committed_steps() if args.all else [_pick_step(store, args.step)]
    if not steps:   # nothing read is not "all ok" (a mistyped prefix of an object store lists nothing)
        _pick_step(store, None)
    total = 0
    for s in steps:
        try:
            total += int(read_manifest(store, s).get("bytes", 0))
        except CheckpointError:
            pass
    progress = Progress(total, sys.stderr, not args.quiet)
    bad, gone, done, stopped = {}, set(), [], None
    try:
        for s in steps:
            try:
                d = verify_step(store, s, progress)
            except CheckpointNotFoundError:   # a writer's retention deleted it meanwhile: not damage
                gone.add(s)
                d = None
            done.append(s)
            if d:
                bad[s] = d
    except StorageUnavailableError as e:   # report what was verified, then the error
        stopped = e
    finally:
        progress.close()
    for s in done:
        if s in bad:
            out.write(f"step {s}: DAMAGED, {len(bad[s])} leaf/leaves:\n")
            for where, msg in bad[s]:
                out.write(f"  {problem_text(where, msg)}\n")
        elif s in gone:
            out.write(f"step {s}: deleted while it was being verified (by a writer's retention, or a forced "
                      f"save of it); not damaged\n")
        else:
            out.write(f"step {s}: ok\n")
    if stopped is not None:
        out.write(f"verification stopped: {len(steps) - len(done)} step(s) not verified\n")
        raise stopped
    if bad:
        out.write(f"{len(bad)} of {len(steps)} step(s) damaged. Restoring them raises CorruptCheckpointError; "
                  f"restore an older step, or delete the damaged ones once a good step exists.\n")
    return 1 if bad else 0


# -- timeline --------------------------------------------------------------------------------
def cmd_timeline(args, store, out) -> int:
    from . import timeline
    recs = timeline.records_from_manifests(store, last=args.last)
    page = timeline.render_svg(recs) if args.svg else timeline.render_html(recs, source=f"{store.url}, {len(recs)} most recent committed saves")
    if args.output == "-":
        out.write(page)
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(page)
    out.write(f"wrote {args.output}: {len(recs)} saves\n")
    return 0


# -- bench (owned by ckpt_callbacks.bench) ---------------------------------------------------
def cmd_bench(argv, out) -> int:
    import importlib
    try:
        bench = importlib.import_module("ckpt_callbacks.bench")
    except ModuleNotFoundError as e:
        if e.name != "ckpt_callbacks.bench":
            raise
        sys.stderr.write("ckpt-callbacks bench: this installation has no benchmark module "
                         "(ckpt_callbacks.bench is missing); install a version that ships it.\n")
        return 2
    return int(bench.main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt-callbacks", description="Inspect, verify, prune and picture "
                                "ckpt_callbacks checkpoint directories (local paths, file://, s3://, gs://).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{ls,inspect,verify,gc,timeline,bench}")
    d = {"help": "checkpoint directory: path, file://, s3://bucket/prefix or gs://bucket/prefix"}
    s = sub.add_parser("ls", help="list steps: committed or partial, size, metrics, best marked")
    s.add_argument("directory", **d)
    s.add_argument("--best", type=lambda t: _parse_best(t, False), metavar="METRIC:min|max",
                   help="mark the best step by this metric (default: the KeepBest the run recorded)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("inspect", help="the tree of one step: key paths, shapes, dtypes, shardings, bytes")
    s.add_argument("directory", **d)
    s.add_argument("--step", type=int, help="step to inspect (default: latest committed)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("verify", help="read every leaf and check every checksum; exit 1 on damage")
    s.add_argument("directory", **d)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="step to verify (default: latest committed)")
    g.add_argument("--all", action="store_true", help="verify every committed step")
    s.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    s = sub.add_parser("gc", help="delete committed steps a retention policy does not keep")
    s.add_argument("directory", **d)
    s.add_argument("--keep-last", type=_positive_int, metavar="N", help="keep the N newest steps")
    s.add_argument("--keep-every", type=_positive_int, metavar="N", help="keep steps that are multiples of N")
    s.add_argument("--keep-best", type=lambda t: _parse_best(t, True), metavar="METRIC:min|max[:N]",
                   help="keep the N best steps by a metric saved with them")
    s.add_argument("--keep-steps", type=_steps_list, metavar="S1,S2", help="keep these steps")
    s.add_argument("--keep-every-n-seconds", type=_positive_seconds, metavar="S", help="keep the first step of each S-second window")
    s.add_argument("--remove-partial", action="store_true", help="also remove leftovers of interrupted saves")
    s.add_argument("--verify", action="store_true",
                   help="first read the steps to keep and check their checksums: a damaged one is kept but does "
                        "not count, so an older intact step is kept in its place (reads their bytes)")
    s.add_argument("--dry-run", action="store_true", help="print what would be deleted; change nothing")
    s = sub.add_parser("timeline", help="render recent saves' phases (snapshot, write, commit, gc) as HTML/SVG")
    s.add_argument("directory", **d)
    s.add_argument("-o", "--output", default="ckpt-timeline.html", help="output file, '-' for stdout")
    s.add_argument("--last", type=_positive_int, default=50, metavar="N", help="the N most recent committed saves")
    s.add_argument("--svg", action="store_true", help="write only the SVG picture (for docs)")
    sub.add_parser("bench", help="benchmarks (see `ckpt-callbacks bench --help`)", add_help=False)
    return p


def main(argv=None) -> int:
    """Entry point of the `ckpt-callbacks` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":   # its cells' processes pick their platform (`stall`: the accelerator)
        return cmd_bench(argv[1:], sys.stdout)
    saved = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"   # never touch an accelerator from the CLI
    try:
        return _main(argv, sys.stdout)
    finally:
        if saved is None:
            os.environ.pop("JAX_PLATFORMS", None)
        else:
            os.environ["JAX_PLATFORMS"] = saved


def _inside_a_step(root: str) -> str | None:
    """The step (or leftover) directory that local directory `root` is or lies in, if any: such a
    directory holds no steps, and `gc` would put its lock there."""
    from . import format as fmt
    path = os.path.realpath(root)
    while os.path.dirname(path) != path:
        name = os.path.basename(path)
        if fmt.STEP_RE.match(name) or fmt.STAGING_RE.match(name):
            return path
        path = os.path.dirname(path)
    return None


def _main(argv, out) -> int:
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:], out)
    args = build_parser().parse_args(argv)
    from .errors import CheckpointError, CheckpointNotFoundError, ConfigError
    from .storage import open_store
    try:
        store = open_store(args.directory)
        if store.local and not os.path.isdir(store.root):   # a typo in the path is not "0 committed"
            if os.path.exists(store.root):   # e.g. a step's manifest given for its directory
                raise CheckpointNotFoundError(f"{store.url} is a file, not a checkpoint directory (give the "
                                              f"directory that holds the step_N directories)")
            raise CheckpointNotFoundError(f"{store.url}: no such directory")
        step_dir = store.local and not store.committed_steps() and _inside_a_step(store.root)
        if step_dir:   # `ls run/step_0000000040`: not an empty run
            raise CheckpointNotFoundError(
                f"{store.url} is a step's directory (or inside one), not a checkpoint directory: give the "
                f"directory that holds the step_N directories, {os.path.dirname(step_dir)}")
        if args.cmd == "gc":
            from .cli_gc import cmd_gc
            return cmd_gc(args, store, out)
        return {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify,
                "timeline": cmd_timeline}[args.cmd](args, store, out)
    except BrokenPipeError:   # `ckpt-callbacks inspect DIR | head`: the reader left; stop quietly
        sys.stdout = open(os.devnull, "w")
        return 0
    except ConfigError as e:   # e.g. `s3://` without a bucket: bad usage, as argparse's refusals
        sys.stderr.write(f"ckpt-callbacks {args.cmd}: {type(e).__name__}: {e}\n")
        return 2
    except (CheckpointError, ValueError, OSError) as e:
        sys.stderr.write(f"ckpt-callbacks {args.cmd}: {type(e).__name__}: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
