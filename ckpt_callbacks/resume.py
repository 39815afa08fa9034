"""Which committed step a restore reads, and which saved host state this process resumes from.

Example::

    import numpy as np
    import ckpt_callbacks as cc
    with cc.CheckpointManager("/tmp/run") as mngr:
        mngr.save(1, {"w": np.ones(3)}, host_state={"data": 7})
        tree = mngr.restore(fallback=True)             # -> resume.read(mngr, None, None, True)
        print(mngr.restored_step, mngr.host_state())   # 1 {'data': 7}

Who calls what: `CheckpointManager.restore` and `.host_state`, on every process with the same
arguments (SPMD), after waiting for the manager's own save in flight. With several processes
(a writing manager, or a read-only one restoring onto arrays that span processes: `collective`),
`read` has process 0 list the steps (`agreed_candidates`) and every process try them in the same
order, telling each other after each step how it went (`all_gather` with the manager's timeout),
so that all restore the same step, fall back past a damaged one together, and raise the same
class of error together; a named step is read so too where the target spans processes. Any other
read-only restore, or a named step onto a target each process holds whole, decides alone on
each process. `host_state_together` (AsyncCheckpoint's resume, every process) reads each
process's own host state and tells the others how that went, so that all raise or none do.
"""

from __future__ import annotations

import logging

import jax
import msgpack

from . import restore as restore_mod
from . import targets, treepath
from .errors import (CheckpointError, CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                     IncompatibleCheckpointError, StorageUnavailableError)

__all__ = ["read", "collective", "named", "host_state", "host_state_together"]

log = logging.getLogger("ckpt_callbacks")


def collective(target) -> bool:
    """Whether restoring onto `target` builds an array that spans several processes: every
    process must make that call, so a read-only manager's processes can agree on its step."""
    try:   # (`treepath.flatten`, not jax's: a container holding itself is refused, not recursed into)
        leaves = treepath.flatten(target).leaves
    except (TypeError, ValueError):   # e.g. mixed dict keys: the restore refuses it, naming the key path
        return False
    return any(isinstance(s := getattr(targets.concrete(leaf), "sharding", None), jax.sharding.Sharding)
               and not targets.abstract(s) and not s.is_fully_addressable for leaf in leaves)


def read(mngr, step, target, fallback: bool, coord=None, partial: bool = False):
    """`CheckpointManager.restore` of one attempt: `step`, or the latest (with `fallback`, the newest
    intact) committed step, onto `target`; sets `mngr.restored_step`. The processes agree through
    `coord` (a read-only manager's collective restore) or a writing manager's own coordinator."""
    coord = coord if coord is not None or mngr.read_only else mngr.coord
    multi = coord is not None and coord.process_count > 1
    spans = multi and collective(target)   # every process makes this call
    missing = None
    if step is not None:
        fallback = False
        try:
            candidates = [mngr._resolve(step)]
        except CheckpointNotFoundError as e:   # not listed here
            if not spans:
                raise
            # listed on another process (a save committing or retention deleting between the
            # listings): told to them below as a step gone, so that every process raises
            e.deleted, missing, candidates = True, e, [int(step)]
    elif multi:   # process 0 lists the steps and tells the others: all try the same ones
        candidates = agreed_candidates(mngr, fallback, coord)
    else:
        steps = mngr.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {mngr.store.url}")
        candidates = steps[::-1] if fallback else steps[-1:]
    # every process moves to the same step: a step that one process found damaged, or deleted
    # while it was read (a save committing meanwhile), is left (or retried) by all of them; a
    # named step too where every process must make the call (arrays that span them), so that no
    # process returns while another raises
    together = multi and (fallback or step is None or spans)
    for i, s in enumerate(candidates):
        error = failure = None
        try:
            try:
                if missing is not None:
                    raise missing
                tree = restore_mod.restore(mngr.store, s, target, partial)
                if fallback:   # this process's host state (a data position) is the step's too
                    check_host_state(mngr, s)
            except IncompatibleCheckpointError as e:
                e.step = s   # which step did not match (a fallback may have passed others)
                raise
            except CheckpointNotFoundError as e:   # committed, so a missing manifest is damage
                if getattr(e, "deleted", False):   # unless the step went while it was read
                    raise
                if s not in mngr.store.committed_steps():   # (between listing and reading)
                    raise restore_mod.deleted_error(mngr.store, s) from e
                raise CorruptCheckpointError(f"step {s} is committed but unreadable: {e}") from None
        except CorruptCheckpointError as e:
            if not fallback:
                told = named(mngr.store.url, s, e)   # which step of which run, and the ways out
                if not together:
                    if told is e:
                        raise
                    raise told from e
                e = told
            error = e
        except Exception as e:   # not damage (e.g. storage unavailable): no fallback, on any process
            if not together:
                raise
            failure = e
        if together:
            mngr._nrestores += 1
            deleted = isinstance(failure, CheckpointNotFoundError) and getattr(failure, "deleted", False)
            mine = (b"D" if deleted else b"U" if isinstance(failure, StorageUnavailableError)
                    else b"!" if failure is not None else b"1" if error is None else b"0")
            oks = coord.all_gather(f"restore/{mngr._nrestores}/ok", mine, mngr.timeout_s)
            if failure is not None and not deleted:
                raise failure
            failed = [p for p, ok in enumerate(oks) if ok in (b"U", b"!")]
            if failed:   # the same class everywhere: a caller that retries does so on every process
                cls = StorageUnavailableError if b"U" in oks else CheckpointError
                raise cls(f"restoring step {s} failed on process(es) {failed} (see their errors)")
            if b"D" in oks:   # `restore` lists the steps again, on every process
                raise failure if deleted else restore_mod.deleted_error(mngr.store, s)
            if error is None and b"0" in oks:
                bad = [p for p, ok in enumerate(oks) if ok == b"0"]
                error = CorruptCheckpointError(f"step {s} is damaged on process(es) {bad} (see their errors)")
                if not fallback:
                    error = named(mngr.store.url, s, error)
            if error is not None and not fallback:
                raise error
        if error is None:
            mngr.restored_step = s
            mngr._fell_past.update(candidates[:i])   # damaged: retention neither counts nor deletes them
            return tree
        nxt = candidates[i + 1] if i + 1 < len(candidates) else None
        log.warning("ckpt_callbacks: step %d in %s is damaged (%s); %s", s, mngr.store.url, error,
                    f"falling back to step {nxt}" if nxt is not None else "no older step to fall back to")
    raise CorruptCheckpointError(f"every committed step up to {candidates[0]} in {mngr.store.url} is damaged")


def named(url: str, step: int, e: CorruptCheckpointError) -> CorruptCheckpointError:
    """`e` saying which step of which run is damaged, and the ways out (once)."""
    if getattr(e, "step_named", False):
        return e
    out = CorruptCheckpointError(
        f"step {step} in {url} is damaged: {e}\nFix: resume from the newest intact step "
        f"(CheckpointManager.restore(fallback=True), CheckpointHook.restore_or_init(..., "
        f"fallback=True), AsyncCheckpoint(..., fallback=True)), or find the damaged steps "
        f"with `ckpt-callbacks verify {url} --all` and remove them.",
        getattr(e, "key_path", None))
    out.step_named = True
    return out


def check_host_state(mngr, step: int) -> None:
    """Read this process's host state of `step`, if it saved one (CorruptCheckpointError if damaged)."""
    m = restore_mod.read_manifest(mngr.store, step)
    if mngr.coord.process_index in (m.get("host") or {}):
        restore_mod.read_host_state(mngr.store, step, m, mngr.coord.process_index)


def agreed_candidates(mngr, fallback: bool, coord) -> list[int]:
    """The steps every process tries, newest first (all with `fallback`, else the latest), as
    process 0 lists them: one list even while a save commits or retention deletes meanwhile."""
    mngr._nrestores += 1
    mine = failure = None
    if coord.process_index == 0:
        try:
            steps = mngr.all_steps()
            mine = msgpack.packb([steps[::-1] if fallback else steps[-1:], None])
        except Exception as e:   # noqa: BLE001 - told to the others, then re-raised
            failure = e
            mine = msgpack.packb([[], f"{type(e).__name__}: {e}"])
    steps, err = msgpack.unpackb(coord.broadcast(f"restore/{mngr._nrestores}/latest", mine, mngr.timeout_s))
    if failure is not None:
        raise failure
    if err is not None:
        cls = StorageUnavailableError if err.startswith("StorageUnavailableError") else CheckpointError
        raise cls(f"listing the committed steps of {mngr.store.url} on process 0 failed: {err}")
    if not steps:
        raise CheckpointNotFoundError(f"no committed checkpoint in {mngr.store.url}")
    return steps


def host_state_together(mngr, step: int, coord=None, **kw):
    """`mngr.host_state(step)` (this process's own) read on every process at once: where it fails
    on one process (its ``host/p<i>.msgpack`` damaged, storage it cannot reach), every process
    raises (the others naming it, with the same class of error), rather than that one alone while
    the others train on into their first collective with it, which then hangs. Called on every
    process (SPMD) by a writing manager's user after its restore of `step`, e.g. `AsyncCheckpoint`;
    a read-only manager's passes `coord`, a scope of its own (`coordination.for_collective_read`);
    `kw` (``remap=``) go to `host_state`. `CheckpointHook.restore_or_init` reads through it too."""
    coord = coord if coord is not None else mngr.coord
    state = failure = None
    try:
        state = mngr.host_state(step, **kw)
    except Exception as e:  # noqa: BLE001 - told to the others, then raised
        failure = e
    if coord.process_count > 1:
        mngr._nrestores += 1
        mine = (b"1" if failure is None else b"0" if isinstance(failure, CorruptCheckpointError)
                else b"U" if isinstance(failure, StorageUnavailableError) else b"!")
        oks = coord.all_gather(f"restore/{mngr._nrestores}/host", mine, mngr.timeout_s)
        bad = [p for p, ok in enumerate(oks) if ok != b"1"]
        if failure is None and bad:
            codes = {oks[p] for p in bad}
            cls = (CorruptCheckpointError if b"0" in codes else StorageUnavailableError if b"U" in codes
                   else CheckpointError)
            failure = cls(f"reading the host state of step {step} failed on process(es) {bad} (see their errors)")
            if cls is CorruptCheckpointError:
                failure = named(mngr.store.url, step, failure)
    if failure is not None:
        raise failure
    return state


def host_state(mngr, step: int, process_index, remap):
    """`CheckpointManager.host_state` of a committed `step` (see there)."""
    try:
        m = restore_mod.read_manifest(mngr.store, step)
    except CheckpointNotFoundError as e:   # committed, so a missing manifest is damage (as in restore)
        raise CorruptCheckpointError(f"step {step} is committed but unreadable: {e}") from None
    pi, pc = mngr.coord.process_index, mngr.coord.process_count
    saved = sorted((m.get("host") or {}).keys())

    def saved_state(p, what):   # a wrong index is an error, not "no host state was saved"
        if not isinstance(p, int) or isinstance(p, bool):
            raise ConfigError(f"{what} must be a saved process index (an int), got {p!r}")
        if saved and p not in saved:
            raise ConfigError(f"{what}={p}: step {step} holds the host state of processes {saved} only")
        return restore_mod.read_host_state(mngr.store, step, m, p)

    if process_index is not None:
        return saved_state(process_index, "process_index")
    if callable(remap):
        return remap({p: restore_mod.read_host_state(mngr.store, step, m, p) for p in saved}, pi, pc)
    if remap is not None:
        if not isinstance(remap, dict):
            raise ConfigError(f"remap must be a dict {{this_process: saved_process}} or a callable, got {remap!r}")
        if pi not in remap:
            raise ConfigError(f"remap has no entry for process {pi} (it maps {sorted(remap)}); "
                              f"give every process of this run ({pc}) a saved process index {saved}")
        return saved_state(remap[pi], f"remap[{pi}]")
    saved_pc = int(m.get("process_count", 1))
    if saved and saved_pc != pc:
        raise IncompatibleCheckpointError(
            f"step {step} in {mngr.store.url} holds host state (e.g. data-iterator positions) of "
            f"{saved_pc} processes {saved}, but this run has {pc} processes, so which saved state "
            f"process {pi} resumes from is not known (the data pipeline's sharding changes with the "
            f"process count). Fix: pass remap={{this_process: saved_process}} or "
            f"remap=fn(saved_states, process_index, process_count), or process_index=, to say "
            f"which state each process resumes from (or restart the data pipeline).",
            [(f"host_state[{pi}]", f"{saved_pc} processes", f"{pc} processes")])
    return restore_mod.read_host_state(mngr.store, step, m, pi)
