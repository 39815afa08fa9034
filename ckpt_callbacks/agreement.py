"""What every process agrees on before a save starts, and what process 0 says about the call.

Example::

    import numpy as np
    import ckpt_callbacks as cc
    with cc.CheckpointManager("/tmp/run") as mngr:
        mngr.save(5, {"w": np.ones(3)})   # -> agreement.agree(mngr, 5, {}, None, False, plan)
        mngr.save(5, {"w": np.ones(3)})   # committed already: skipped with a warning, returns False

Who calls what: `CheckpointManager.save`, on every process with the same arguments (SPMD), after
its own checks of the call (a failed check is `refused`, told to the others rather than raised at
once) and after waiting for the save before it: `agree` has process 0 list the committed steps and
draw the save's token, exchanges every process's step, refusal, metrics and tree digest in one
`all_gather` (with the manager's timeout), and raises the same error on every process where they
differ. `warn_below` and `warn_unranked` run on process 0 only and only log.
"""

from __future__ import annotations

import logging
import os

import msgpack

from . import snapshot
from .errors import CheckpointSaveError
from .retention import KeepBest, has_number

__all__ = ["agree", "warn_below", "warn_unranked"]

log = logging.getLogger("ckpt_callbacks")


def agree(mngr, step: int, metrics: dict, refused: Exception | None,
                   replace: bool = False, snap=None) -> tuple[str, bool, dict]:
    """(the save's token, whether `step` is committed, the metrics to record), the same on every
    process: with several processes, each listing for itself could answer differently (an
    outage on one) and leave their save counters apart for good. So do a call that only one
    process refuses (its own checks: metrics, host state, tree), saves of different steps
    (e.g. threads whose saves reach the processes in different orders), and metrics given on
    one process only: every process hears of all of it here, and refuses alike (nothing
    started; the next save tries again). The metrics recorded are process 0's, or, where it
    gave none, the first process's that did. A listing that fails fails the save everywhere
    (CheckpointSaveError). Trees planned differently (`snapshot.structure`: another key, shape,
    dtype or sharding on one process) are refused too, naming the first difference: each
    process would write files the others' manifest names otherwise, and the step, committed,
    would read as damaged."""
    pi, multi = mngr.coord.process_index, mngr.coord.process_count > 1
    why = None if refused is None else f"{type(refused).__name__}: {refused}"
    digest, lines = snapshot.structure(snap) if multi and snap is not None else (None, None)
    mine, error = [step, why, metrics if refused is None else {}, None, False, None, digest], None
    if pi == 0:
        try:
            mine[3:5] = [os.urandom(6).hex(), mngr.store.has_step(step)]
            if not replace:
                warn_below(mngr, step)
        except Exception as e:  # noqa: BLE001 - told to the others, then raised everywhere
            error = e
            mine[5] = f"{type(e).__name__}: {mngr.store.redact(str(e))}"
    got = [mine]
    if multi:
        mngr._nsaves += 1
        got = [msgpack.unpackb(g) for g in mngr.coord.all_gather(
            f"save/{mngr._nsaves}/agree", msgpack.packb(mine), mngr.timeout_s)]
    steps = {i: g[0] for i, g in enumerate(got)}
    if len(set(steps.values())) > 1:
        raise CheckpointSaveError(
            f"nothing was saved: the processes called save() with different steps ({steps}); every "
            f"process must save the same steps in the same order (one thread saving per process)",
            {i: f"step {s}" for i, s in steps.items()})
    failures = {i: g[1] for i, g in enumerate(got) if g[1] is not None}
    if refused is not None:
        raise refused
    if failures:
        raise CheckpointSaveError(
            f"step {step} was not saved: process(es) {sorted(failures)} refused the call "
            f"({'; '.join(f'{i}: {w}' for i, w in failures.items())}); nothing was started", failures)
    if len({g[6] for g in got}) > 1:
        _refuse_other_trees(mngr, step, got, lines)
    token, committed, failed = got[0][3:6]
    if failed is not None:
        raise CheckpointSaveError(
            f"step {step} was not saved: the committed steps of {mngr.store.url} cannot be listed "
            f"({failed}); nothing was started, the next save tries again", {0: failed}) from error
    return token, committed, got[0][2] or next((g[2] for g in got if g[2]), {})


def _refuse_other_trees(mngr, step: int, got: list, lines: list) -> None:
    """CheckpointSaveError naming, for each process whose tree differs from process 0's, the first
    leaf that differs (every process exchanges its leaf lines: only on this failure path)."""
    every = [msgpack.unpackb(g) for g in mngr.coord.all_gather(
        f"save/{mngr._nsaves}/trees", msgpack.packb(lines), mngr.timeout_s)]
    first, failures = every[0], {}
    for p, other in enumerate(every[1:], 1):
        if got[p][6] == got[0][6]:
            continue
        i = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
        has = other[i] if i < len(other) else f"no leaf #{i} ({len(other)} leaves)"
        want = first[i] if i < len(first) else f"no leaf #{i} ({len(first)} leaves)"
        failures[p] = f"leaf #{i}: {has}; process 0: {want}" if i < max(len(first), len(other)) else \
            "the same leaves in another tree structure"
    raise CheckpointSaveError(
        f"step {step} was not saved: the processes passed different trees (every process must save the "
        f"same tree: the same keys, shapes, dtypes and shardings; per-process data goes in host_state): "
        + "; ".join(f"process {p} at {w}" for p, w in failures.items()) + "; nothing was started", failures)


def warn_below(mngr, step: int) -> None:
    """(Process 0, once per manager.) A save below the directory's latest committed step, e.g. a
    new run started in an old run's directory without restoring: retention ranks steps by
    number, so `KeepLast` deletes such a step right after it commits, and a later restore
    reads the old run's latest; a step that run committed is not saved again (the Flax hook
    skips it without a word). Said, not refused: the save goes on. Not said where this manager
    committed the latest step itself (the run is this one; e.g. a final save of an earlier step),
    nor below damaged steps that a fallback restore went past (the run resumed below them). The
    steps are listed only until this manager has committed the latest: it is the directory's only
    writer (its lock), so no newer step can appear but its own, and a save need not list thousands."""
    if mngr._warned_below or mngr._top_saved >= mngr._listed_top:
        return
    steps = [s for s in mngr.all_steps() if s not in mngr._fell_past]
    mngr._listed_top = steps[-1] if steps else -1
    if not steps or step >= steps[-1] or mngr._top_saved >= steps[-1]:
        return
    mngr._warned_below = True
    log.warning("ckpt_callbacks: saving step %d below the latest committed step %d in %s (an earlier "
                "run's?): retention ranks steps by number, so a KeepLast policy deletes the steps saved "
                "below it as soon as they commit, a step committed already is not saved again, and "
                "restore() reads step %d. To continue that run, restore() first and save the steps "
                "after it; for a new run, use a new directory.", step, steps[-1], mngr.store.url, steps[-1])


def warn_unranked(mngr, step: int, metrics: dict) -> None:
    """(Process 0, once per metric.) Metrics saved without the one a `KeepBest` ranks by: such a
    step never ranks. Expected for saves without evaluation; a typo otherwise, which would
    leave no step ranked and the best steps deleted as they fall out of the other policies."""
    if not metrics:
        return
    for p in mngr.policies or []:
        if isinstance(p, KeepBest) and p.metric not in mngr._warned_unranked and not has_number(metrics, p.metric):
            mngr._warned_unranked.add(p.metric)
            if p.metric in metrics:   # there, but a str or bool: never a rank
                v = metrics[p.metric]
                log.warning("ckpt_callbacks: retention ranks steps by %r (KeepBest), but step %d saved it as a %s "
                            "(%r), which never ranks: save it as a number.", p.metric, step, type(v).__name__, v)
                continue
            log.warning("ckpt_callbacks: retention ranks steps by %r (KeepBest), but the metrics saved with step "
                        "%d do not have it (they have: %s): such steps never rank as best. Expected for saves "
                        "without evaluation (e.g. Keras epochs without validation, validation_freq > 1); "
                        "otherwise check the metric's name.", p.metric, step, ", ".join(sorted(metrics)))
