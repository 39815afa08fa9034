"""After a commit: the committed steps' save times and metrics, and retention applied to them.

Example::

    import numpy as np
    import ckpt_callbacks as cc
    with cc.CheckpointManager("/tmp/run", retention=cc.KeepLast(2)) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"w": np.ones(3)}, metrics={"loss": 1 / step})
        mngr.wait_until_finished()          # step 3's writer ran retain.apply: step 1 is deleted
        print(mngr.all_steps(), mngr.metrics(3))   # [2, 3] {'loss': 0.333...}

Who calls what: the manager's writer thread, after each durable commit, calls `apply` on every
process: process 0 reads each committed step's manifest once (`step_infos`, cached on the manager
and read again where a local step was replaced since), decides with the policies
(`retention.decide`) and deletes; then it tells the others (`broadcast`, the manager's timeout),
who wait, so that every process sees the same committed steps once its save has finished.
`CheckpointManager.metrics` and `.best_step` read `step_infos` on the calling process.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgpack

from . import restore as restore_mod
from .errors import CheckpointError, StorageUnavailableError
from .retention import StepInfo, decide
from .writing import SaveStats

__all__ = ["apply", "step_infos", "step_info", "local_token"]

log = logging.getLogger("ckpt_callbacks")


def apply(mngr, stats: SaveStats, token: str = "") -> SaveStats:
    """Process 0 decides and deletes; then it tells the others (who wait), so that every
    process sees the same committed steps once its save has finished."""
    if mngr.policies is None:
        return stats
    t0 = time.perf_counter()
    deleted, err = [], None
    if mngr.coord.process_index == 0:
        doing = "reading the steps' metrics"
        try:
            # the chunk files of steps deleted after the previous save were there for this
            # save to overwrite (localstore.LocalStore.claim); what it did not take goes now
            mngr.store.drop_reusable(mngr._workers and mngr._workers.fsync)
            infos = step_infos(mngr)
            keep = decide(mngr.policies, infos)
            for s in sorted(i.step for i in infos if i.step not in keep):
                doing = f"deleting step {s}"
                mngr.store.delete(s, reuse=True)
                deleted.append(s)
        except StorageUnavailableError as e:   # nothing is lost by waiting: tried again after the next save
            log.warning("ckpt_callbacks: retention after step %d skipped (storage unavailable): %s", stats.step, e)
        except Exception as e:  # noqa: BLE001 - told to the others, then raised
            err = CheckpointError(
                f"step {stats.step} was committed, but retention failed {doing} in {mngr.store.url}: "
                f"{type(e).__name__}: {mngr.store.redact(str(e))}. Nothing committed was lost: the steps "
                f"not deleted stay listed, and retention runs again after the next save.")
            err.__cause__ = e
    if mngr.coord.process_count > 1:
        msg = msgpack.packb([deleted, None if err is None else str(err)])
        deleted, remote = msgpack.unpackb(mngr.coord.broadcast(
            f"retain/{token}", msg if mngr.coord.process_index == 0 else None, mngr.timeout_s))
        if remote is not None and err is None:
            err = CheckpointError(f"(on process 0) {remote}")
    for s in deleted:
        mngr._infos.pop(s, None)
        mngr._info_tokens.pop(s, None)
    if err is not None:
        raise err
    return dataclasses.replace(stats, gc_s=time.perf_counter() - t0, deleted=tuple(deleted))


def local_token(mngr, step: int):
    """`Store.step_token` where it costs a `stat` (a local directory), else None."""
    return mngr.store.step_token(step) if mngr.store.local else None


def step_infos(mngr) -> list[StepInfo]:
    """Each committed step's time and metrics, read once from its manifest; read again where a
    local step was replaced since (a forced save through another manager or process). Not the
    damaged steps a fallback restore went past: like a damaged manifest's, they are never ranked
    nor deleted, and a `KeepLast` does not count them (it would delete the intact steps the
    resumed run saves below them, the step it resumed from first)."""
    steps = [s for s in mngr.store.committed_steps() if s not in mngr._fell_past]
    for s in steps:
        step_info(mngr, s)
    infos = [mngr._infos.get(s) for s in steps]   # background retention may drop a step meanwhile
    return [i for i in infos if i is not None]


def step_info(mngr, s: int) -> StepInfo | None:
    """Committed step `s`'s time and metrics, as `step_infos` reads them, for that step alone
    (`CheckpointManager.metrics`: reading one step costs one step, not one per committed step).
    None where its manifest cannot be read (recorded in `mngr._damaged`) or the step went."""
    token = local_token(mngr, s)
    if mngr._info_tokens.get(s) != token:
        mngr._infos.pop(s, None)   # (background retention may drop it meanwhile)
    for _ in range(2):   # once more where the step was replaced while it was read
        if s in mngr._infos:
            break
        mngr._info_tokens[s] = token
        try:
            m = restore_mod.read_manifest(mngr.store, s)
            mngr._infos[s] = StepInfo.of_manifest(s, m)
        except StorageUnavailableError:
            raise   # says nothing about the step: not remembered as metric-less
        except CheckpointError as e:
            if s not in mngr.store.committed_steps():   # deleted while read (the writer's retention)
                mngr._info_tokens.pop(s, None)
                break
            if (now := local_token(mngr, s)) != token:   # replaced while read (a forced save)
                token = now
                continue
            # damaged: listed, never ranked, never deleted by retention (its metrics are
            # unknown: it may be the best), as `ckpt-callbacks gc` does; read again next time
            if s not in mngr._damaged:
                log.warning("ckpt_callbacks: step %d in %s: cannot read its manifest (%s); kept "
                            "(run `ckpt-callbacks verify`)", s, mngr.store.url, e)
            mngr._damaged[s] = str(e)
            break
        mngr._damaged.pop(s, None)
    return mngr._infos.get(s)
