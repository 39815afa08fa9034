"""`ckpt-callbacks gc`: apply a retention policy to a checkpoint directory from a shell.

Example::

    import ckpt_callbacks as cc
    from ckpt_callbacks.cli import main
    with cc.CheckpointManager("/tmp/run") as mngr:
        for step in (1, 2, 3, 4):
            mngr.save(step, {"w": step}, metrics={"val_loss": 1 / step})
    main(["gc", "/tmp/run", "--keep-last", "1", "--keep-best", "val_loss:min:2", "--dry-run"])
    main(["gc", "/tmp/run", "--keep-last", "1", "--keep-best", "val_loss:min:2"])   # deletes steps 1 and 2

Who calls what: `ckpt_callbacks.cli.main` runs `cmd_gc` in this process for ``gc``. On a local
directory it takes the writer lock first (refused while a live trainer writes there), puts back a
step whose forced replacement was interrupted, reads every committed step's manifest, and decides
with the same policies and `retention.decide` as a manager's retention: a step whose manifest
cannot be read is kept, and with ``--verify`` so is a damaged step, which then does not count
toward the policy. ``--dry-run`` changes nothing and takes no lock, but is refused as gc would be
while a live process holds it.
"""

from __future__ import annotations

import sys

from . import lock
from .cli import leftover_records, read_manifests

__all__ = ["cmd_gc"]


def cmd_gc(args, store, out) -> int:
    from .errors import ConfigError
    from .retention import StepInfo, best_policy, decide, has_number, retention_from_config
    from .verify import problem_text
    config = {"keep_last": args.keep_last, "keep_every": args.keep_every, "keep_best": args.keep_best,
              "keep_steps": args.keep_steps, "keep_every_n_seconds": args.keep_every_n_seconds}
    config = {k: v for k, v in config.items() if v is not None}
    if not config:
        sys.stderr.write("ckpt-callbacks gc: give at least one retention flag (--keep-last, --keep-every, --keep-best, --keep-steps, "
                  "--keep-every-n-seconds); nothing deleted\n")
        return 2
    try:
        policies = retention_from_config(config, "gc")
    except ConfigError as e:   # a bad flag value: bad usage, as argparse's own refusals
        sys.stderr.write(f"ckpt-callbacks gc: {e}\n")
        return 2
    locked = False
    if store.local and args.dry_run:
        lock.check_free(store.root)   # as gc itself would be: its "would delete" list would be untrue
    elif store.local:
        lock.acquire(store.root)   # CheckpointLockedError while a live trainer writes here
        locked = True
    try:
        # a step whose forced replacement died between its two renames exists only as `.old-`:
        # put back first, as a manager's start-up does (never removed as a leftover)
        back = store.recoverable()
        if not args.dry_run:
            store.recover()
        ms = read_manifests(store, store.committed_steps())
        steps = list(ms)
        unreadable = [s for s in steps if not isinstance(ms[s], dict)]
        infos = [StepInfo.of_manifest(s, m) for s, m in ms.items() if isinstance(m, dict)]
        bp = best_policy(policies)
        if bp is not None and infos and not bp.rank(infos):   # a typo would keep no best at all
            seen = sorted({k for i in infos for k in i.metrics if has_number(i.metrics, k)})
            sys.stderr.write(f"ckpt-callbacks gc: --keep-best {bp.metric}: no committed step reported "
                             f"{bp.metric!r} (as a number; they report: {', '.join(seen) or 'no metrics'}), so it "
                             f"would keep no best step; nothing deleted. Fix: check the metric's name, or "
                             f"leave out --keep-best\n")
            return 2
        absent = sorted(set(args.keep_steps or ()) - set(steps))
        if absent:   # a typo (5000 for 500) would delete the step meant
            sys.stderr.write(f"ckpt-callbacks gc: --keep-steps {','.join(map(str, absent))}: not committed in "
                             f"{store.url} (committed: {_steps_text(steps)}), so it keeps nothing; nothing "
                             f"deleted. Fix: check the steps (`ckpt-callbacks ls`), or leave them out\n")
            return 2
        damaged = _damaged_kept(store, policies, infos) if args.verify else {}
        keep = decide(policies, [i for i in infos if i.step not in damaged]) | set(unreadable) | set(damaged)
        delete = [s for s in steps if s not in keep]
        partial = [p for p in leftover_records(store, steps) if p["status"] != "recoverable"] if args.remove_partial else []
        verb = "would delete" if args.dry_run else "deleting"
        for n, s in back.items():
            out.write(f"  put back step {s} from {n} (its forced replacement was interrupted)\n" if not args.dry_run
                      else f"  would put back step {s} from {n} (its forced replacement was interrupted; "
                           f"not counted by this dry run)\n")
        out.write(f"{store.url}: {len(steps)} committed; keeping {sorted(keep)}\n")
        for s in unreadable:
            out.write(f"  step {s}: manifest unreadable, kept (run `ckpt-callbacks verify`)\n")
        for s, problems in sorted(damaged.items()):
            out.write(f"  step {s}: damaged ({problem_text(*problems[0])}), kept but "
                      f"not counted by the policy (`ckpt-callbacks verify --step {s}` lists it all)\n")
        before = set(store.leftovers()) if locked else set()
        for s in delete:
            out.write(f"  {verb} step {s}\n")
            if not args.dry_run:
                store.delete(s)
        for p in partial:
            out.write(f"  {verb} partial {p['name']}\n" if p["status"] == "partial" else
                      f"  {'would drop' if args.dry_run else 'dropping'} the stale record of committed step "
                      f"{p['step']} (the step stays)\n")
            if not args.dry_run:
                store.remove(p["name"])
        if not delete and not partial:
            out.write("  nothing to delete\n")
        # (local: a remove that fails part-way leaves what it cannot remove, quietly)
        removed = {p["name"] for p in partial}
        stuck = [n for n in store.leftovers() if n not in before or n in removed] if locked else []
        for n in stuck:
            out.write(f"  could not remove all of {n}: some of its files or directories cannot be removed by this "
                      f"process (check their permissions and owner); never restored, removed by "
                      f"`gc --remove-partial` once they can be\n")
        if stuck:
            sys.stderr.write(f"ckpt-callbacks gc: {len(stuck)} director(y/ies) could not be removed completely: "
                             f"{', '.join(stuck)} in {store.url} (the space they hold is not freed)\n")
            return 1
    finally:
        if locked:
            lock.release(store.root)
    return 0


def _steps_text(steps: list, most: int = 12) -> str:
    if len(steps) <= most:
        return ", ".join(map(str, steps)) or "none"
    return f"{', '.join(map(str, steps[:most // 2]))}, ..., {', '.join(map(str, steps[-most // 2:]))}"


def _damaged_kept(store, policies, infos) -> dict:
    """--verify: {step: problems} of the steps that fail `verify_step`, reading only the steps the
    policy keeps, newest first, and deciding again without each damaged one found (so that a damaged
    step never takes the place of an intact one), until every kept step is verified."""
    from .retention import decide
    from .verify import verify_step
    damaged: dict = {}
    ok: set = set()
    while True:
        keep = decide(policies, [i for i in infos if i.step not in damaged])
        todo = sorted(keep - ok, reverse=True)
        if not todo:
            return damaged
        for s in todo:
            problems = verify_step(store, s)   # StorageUnavailableError: nothing is deleted
            if problems:
                damaged[s] = problems
                break
            ok.add(s)
