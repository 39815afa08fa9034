"""CheckpointHook with real Flax training: SIGKILL/SIGTERM on real processes, resharding, retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import ckpt_callbacks as cc
from ckpt_callbacks.flax import CheckpointHook, Preempted
from helpers import assert_tree_equal

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "flax_train_script.py")
STEPS, EVERY, KILL_AT = 16, 5, 12


def _cmd(framework, d, log):
    return [sys.executable, SCRIPT, "--framework", framework, "--dir", d, "--steps", str(STEPS),
            "--every", str(EVERY), "--log", log]


def _run_free(cmd):
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.split("\n")


def _run_lockstep(cmd, at_step, sig):
    """Run `cmd` one step at a time; after it prints ``step at_step``, send `sig`; returns (proc, lines)."""
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("step "):
                n = int(line.split()[1])
                if n == at_step:
                    p.send_signal(sig)
                p.stdin.write("\n")    # let it take the next step (a dead process ignores it)
                p.stdin.flush()
    except BrokenPipeError:
        pass
    finally:
        p.wait(timeout=300)
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except BrokenPipeError:
                pass
    return p, lines


def _log(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def _final(d):
    with cc.CheckpointManager(d, read_only=True) as m:
        assert m.latest_step() == STEPS
        return m.restore(STEPS), m.host_state(STEPS)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_sigkill_midrun_then_rerun_resumes_exactly(tmp_path, framework):
    """Killed with SIGKILL right after hook(12) (a save may be in flight), the same command resumes
    from the latest committed step, and the final params, optimizer state, RNG, iterator position
    and every batch equal an uninterrupted run's, bit for bit."""
    ref_dir, ref_log = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    ref = subprocess.Popen(_cmd(framework, ref_dir, ref_log), stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)   # meanwhile

    d, log = str(tmp_path / "run"), str(tmp_path / "run.jsonl")
    cmd = _cmd(framework, d, log)
    p, lines = _run_lockstep(cmd, KILL_AT, signal.SIGKILL)
    ref_out = ref.communicate(timeout=300)[0]
    assert ref.returncode == 0, ref_out
    assert p.returncode == -signal.SIGKILL and lines[-1] == f"step {KILL_AT}", lines
    with cc.CheckpointManager(d, read_only=True) as m:
        committed = m.latest_step()
    assert committed in (5, 10)   # step 5 is surely committed (the save at 10 waited for it)

    out = _run_free(cmd)          # the same command, unchanged
    assert out[0] == f"start {committed}" and f"done {STEPS}" in out, out

    got, ref = _log(log), _log(ref_log)
    assert [r["step"] for r in got[:KILL_AT]] == list(range(1, KILL_AT + 1))
    resumed = got[KILL_AT:]
    assert [r["step"] for r in resumed] == list(range(committed + 1, STEPS + 1))
    assert got[:committed] + resumed == ref            # the batches that made the final state
    tree, host = _final(d)
    ref_tree, ref_host = _final(ref_dir)
    assert_tree_equal(tree, ref_tree)
    assert host == ref_host
    leaves = jax.tree_util.tree_leaves(tree)
    assert len(leaves) >= 8 and sum(getattr(x, "size", 1) for x in leaves) > 300   # params + adam state


def test_sigterm_saves_the_step_reached_and_exits_cleanly(tmp_path):
    d, log = str(tmp_path / "run"), str(tmp_path / "run.jsonl")
    p, lines = _run_lockstep(_cmd("nnx", d, log), 7, signal.SIGTERM)
    assert p.returncode == 0, lines
    assert "stopped 8" in lines and "step 9" not in lines, lines   # signalled after step 7: 8 saved
    assert not any("Traceback" in x for x in lines), lines
    with cc.CheckpointManager(d, read_only=True) as m:
        assert m.all_steps() == [5, 8]
        assert m.host_state(8) == {"data_iterator": {"next_index": 8}}


def test_sigterm_on_one_of_two_processes_stops_both_at_the_same_saved_step(tmp_path):
    from multiproc import launch
    res = launch("flax_train_script:two_process_preemption", 2, devices_per_process=2, timeout_s=240,
                 args={"root": str(tmp_path / "ckpt")}).raise_if_failed()
    a, b = res.values
    assert a["stopped"] == b["stopped"] == 4              # process 1 was signalled after step 3
    assert a["steps"] == b["steps"] == [4] and a["w"] == b["w"]
    assert a["host"] == b["host"] == {"data_iterator": {"next_index": 4}}


def test_a_second_hook_on_a_shared_manager_of_two_processes_reuses_no_agreement_key(tmp_path):
    """Each hook counted its per-step agreements from 1, so a second hook on the same manager
    failed at its first step: ALREADY_EXISTS, told as a dead coordination service. And the
    coordination service keeps only the last agreement's keys, one per process (they were all
    kept: a store growing with every step of a long run)."""
    from multiproc import launch
    res = launch("flax_train_script:two_hooks_on_one_manager", 2, devices_per_process=2, timeout_s=240,
                 args={"root": str(tmp_path / "ckpt")}).raise_if_failed()
    a, b = res.values
    assert a == b == {"started": [False, True, False, False, True, False], "steps": [2, 4],
                      "agreements_left": ["6", "6"]}


def test_restore_or_init_on_two_processes_resumes_every_process_from_the_same_step(tmp_path):
    """Each process listed the latest step for itself: with a save of the user's manager landing
    meanwhile, process 0 restored step 1 and process 1 started afresh at step 0, silently."""
    from multiproc import launch
    res = launch("flax_train_script:restore_while_a_save_commits", 2, devices_per_process=2, timeout_s=240,
                 args={"root": str(tmp_path / "ckpt")}).raise_if_failed()
    assert res.values == [{"step": 1, "w": [1.0] * 4}] * 2, res.values


def test_a_data_iterator_that_fails_on_one_of_two_processes_fails_that_save_on_both_at_once(tmp_path):
    """Process 1 raised alone before its save's agreement: process 0 waited there for the manager's
    timeout_s (JAX's heartbeat ends it first with the defaults, raising nothing)."""
    from multiproc import launch
    res = launch("flax_train_script:iterator_fails_on_one_process", 2, devices_per_process=2, timeout_s=240,
                 args={"root": str(tmp_path / "ckpt")}).raise_if_failed()
    a, b = res.values
    assert a["errors"][0] is None and a["errors"][2] is None and b["errors"][0] is None and b["errors"][2] is None
    assert b["errors"][1][:2] == ["RuntimeError", "get_state failed at position 2"], b
    assert a["errors"][1][0] == "CheckpointSaveError" and "process(es) [1] refused the call" in a["errors"][1][1], a
    assert "get_state failed" in a["errors"][1][1] and a["errors"][1][2] < 10, a
    assert a["steps"] == b["steps"] == [1, 3] and a["host"] == b["host"] == {"data_iterator": {"pos": 3}}


def test_a_survivor_of_a_process_that_died_raises_within_the_hook_s_timeout_s(tmp_path):
    """CheckpointHook(timeout_s=...) reaches the manager it creates: the survivor's next hook call
    raises within it (the hook had no timeout_s; with 600 s, JAX's heartbeat ends it first, silently)."""
    from multiproc import launch
    res = launch("flax_train_script:survivor_of_a_dead_process", 2, devices_per_process=2, timeout_s=240,
                 args={"root": str(tmp_path / "ckpt"), "timeout_s": 4})
    assert res[1].returncode == 17 and res[0].ok, res[0].describe()
    r = res[0].result
    assert r["error_type"] == "CoordinationTimeoutError" and "within 4s" in r["error"], r
    assert "silent: process 1" in r["error"] and r["waited_s"] < 30, r


def test_metrics_refused_on_one_of_two_processes_fail_that_hook_call_on_both_at_once(tmp_path):
    """Process 0 raised its ConfigError alone, before the hook's agreement: process 1 waited there
    and paired its step-2 call with process 0's step-3 one (they then saved different steps)."""
    from multiproc import launch
    res = launch("flax_train_script:metrics_refused_on_one_process", 2, devices_per_process=2, timeout_s=240,
                 args={"root": str(tmp_path / "ckpt")}).raise_if_failed()
    a, b = res.values
    assert a["errors"][1][:2] == ["ConfigError", "metrics must be a dict of str -> number, got float"], a
    assert b["errors"][1][0] == "CheckpointSaveError" and "process(es) [0] refused the call" in b["errors"][1][1], b
    assert "metrics must be a dict" in b["errors"][1][1] and b["errors"][1][2] < 10, b
    assert [e is None for e in a["errors"]] == [e is None for e in b["errors"]] == [True, False, True]
    assert a["steps"] == b["steps"] == [1, 3]


def test_hook_calls_with_different_steps_on_two_processes_fail_on_both_at_once(tmp_path):
    """Each process decided its schedule from its own step: process 0 saved step 2 and waited in
    that save until timeout_s for process 1, which had skipped it (its step 3 was not due)."""
    from multiproc import launch
    res = launch("flax_train_script:steps_apart", 2, devices_per_process=2, timeout_s=240,
                 args={"root": str(tmp_path / "ckpt")}).raise_if_failed()
    for r in res.values:
        assert r["errors"][0] is None and r["errors"][2] is None, r
        assert r["errors"][1][0] == "CheckpointSaveError", r
        assert "different steps ({0: 2, 1: 3})" in r["errors"][1][1] and r["errors"][1][2] < 5, r
        assert r["steps"] == [4], r


# -- in-process: a sharded NNX model -----------------------------------------------------------------

class Sharded(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, ("data", "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)), rngs=rngs)
        self.l2 = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(init, ("model", "data")), rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def _sharded(mesh_shape, seed):
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = Sharded(nnx.Rngs(params=seed, dropout=seed + 1))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return mesh, model, opt


@nnx.jit
def _nnx_step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss


def _host(tree):
    """Host numpy copies (typed PRNG keys as their key data; Python scalars as they are)."""
    def one(x):
        if not isinstance(x, jax.Array):
            return x
        return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return jax.tree_util.tree_map(one, tree)


def test_sharded_nnx_saved_on_4x2_resumes_on_2x4(ckdir, devices):
    mesh, model, opt = _sharded((4, 2), seed=0)
    x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 32
    with jax.set_mesh(mesh):
        hook = CheckpointHook(ckdir, every_steps=3)
        (model, opt), start = hook.restore_or_init((model, opt))
        assert start == 0
        for step in range(1, 4):
            _nnx_step(model, opt, x)
            hook(step, (model, opt))
        hook.close()
    saved = _host(nnx.state((model, opt)))
    assert model.l1.kernel[...].sharding.spec == P("data", "model")

    mesh2, model2, opt2 = _sharded((2, 4), seed=5)
    with jax.set_mesh(mesh2):
        hook = CheckpointHook(ckdir, every_steps=3)
        (model2, opt2), start = hook.restore_or_init((model2, opt2))
        hook.close()
    assert start == 3
    assert_tree_equal(_host(nnx.state((model2, opt2))), saved)     # params, adam state, rng keys
    k = model2.l1.kernel[...]
    assert k.sharding.mesh.shape == {"data": 2, "model": 4} and k.sharding.spec == P("data", "model")
    assert {s.data.shape for s in k.addressable_shards} == {(4, 4)}
    mu = opt2.opt_state[0].mu["l2"]["kernel"][...]
    assert mu.sharding.mesh.shape == {"data": 2, "model": 4} and {s.data.shape for s in mu.addressable_shards} == {(4, 4)}
    assert jax.dtypes.issubdtype(model2.drop.rngs.key[...].dtype, jax.dtypes.prng_key)
    with jax.set_mesh(mesh2):           # training continues on the new mesh
        assert np.isfinite(float(_nnx_step(model2, opt2, x)))


# -- in-process: schedule, eval retention, preemption ------------------------------------------------

def _tree(step):
    return {"w": np.full((3,), step, np.float32), "step": np.int32(step)}


def test_eval_driven_best_retention_keeps_exactly_expected_steps(ckdir):
    losses = {2: 0.5, 4: 0.2, 6: 0.9, 8: 0.3}
    hook = CheckpointHook(ckdir, every_steps=3,
                          retention=[cc.KeepLast(1), cc.KeepBest("val_loss", "min", n=2)])
    saved = []
    for step in range(1, 11):
        if step in (4, 8):                       # reported ahead of the hook call
            hook.report_eval(step, {"val_loss": losses[step]})
            metrics = None
        else:
            metrics = {"val_loss": losses[step]} if step in losses else None
        if hook(step, _tree(step), metrics=metrics):
            saved.append(step)
        if step == 6:
            with pytest.raises(cc.ConfigError, match="before hook"):
                hook.report_eval(6, {"val_loss": 0.0})
    hook.close()
    assert saved == [2, 3, 4, 6, 8, 9]          # every 3rd step plus every eval step
    with cc.CheckpointManager(ckdir, read_only=True, retention=cc.KeepBest("val_loss", "min", n=2)) as m:
        assert m.all_steps() == [4, 8, 9]        # the 2 best evals and the newest
        assert m.best_step() == 4 and m.metrics(8) == {"val_loss": 0.3}

    # a restarted run rebuilds the ranking from the manifests
    hook = CheckpointHook(ckdir, every_steps=3, retention=[cc.KeepLast(1), cc.KeepBest("val_loss", "min", n=2)])
    tree, start = hook.restore_or_init(_tree(0))
    assert start == 9 and tree["step"] == 9
    hook(10, _tree(10), metrics={"val_loss": 0.1})
    hook(11, _tree(11))
    hook(12, _tree(12), metrics={"val_loss": 0.25})
    hook.close()
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [4, 10, 12]


def test_report_eval_refuses_metrics_that_cannot_be_stored_at_once_and_the_step_is_saved_on_schedule(ckdir):
    """report_eval(4, {"val_loss": per-example losses}) was taken; hook(4, state) then raised
    ConfigError and did not save step 4, which every_steps had scheduled."""
    with CheckpointHook(ckdir, every_steps=2, retention=cc.KeepBest("val_loss"), preemption_signals=()) as hook:
        for bad in ({"val_loss": jnp.ones(3)}, {"val_loss": None}, {1: 0.5}):
            with pytest.raises(cc.ConfigError, match=r"report_eval\(step=4\): metrics"):
                hook.report_eval(4, bad)
        hook.report_eval(4, {"val_loss": jnp.float32(0.25)})   # a 0-d array: stored as a float
        assert [s for s in range(1, 5) if hook(s, _tree(s))] == [2, 4]
        hook.wait_until_finished()
        assert hook.manager.metrics(4) == {"val_loss": 0.25} and hook.manager.best_step() == 4


def test_metrics_reported_for_a_step_saved_with_save_go_with_it(ckdir):
    """report_eval(8, ...) then save(8, state) (the final step, off the schedule) saved step 8
    without its metrics: KeepBest never saw that evaluation and kept step 5 as the best."""
    with CheckpointHook(ckdir, every_steps=10, retention=[cc.KeepLast(1), cc.KeepBest("val_loss")],
                        preemption_signals=()) as hook:
        hook.report_eval(5, {"val_loss": 0.5})
        for step in range(5, 8):
            hook(step, _tree(step))
        hook.report_eval(8, {"val_loss": 0.1})
        assert hook.save(8, _tree(8)) is True
        hook.wait_until_finished()
        assert hook.manager.metrics(8) == {"val_loss": 0.1} and hook.manager.best_step() == 8
        assert hook.manager.all_steps() == [8]


def test_schedule_every_steps_on_steps_every_secs(ckdir):
    now = [100.0]
    hook = CheckpointHook(ckdir, every_steps=4, on_steps=[6], every_secs=30, clock=lambda: now[0],
                          preemption_signals=())
    saved = []
    for step in range(1, 12):
        now[0] += 7.0 if step != 10 else 40.0     # 30 s pass between the saves at 8 and 10
        if hook(step, _tree(step)):
            saved.append(step)
    hook.close()
    # 4 every_steps (t=128); 6 on_steps (t=142); 8 every_steps (t=156); 10 only by the timer (t=203)
    assert saved == [4, 6, 8, 10]
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [4, 6, 8, 10]


def test_sigterm_in_process_saves_off_schedule_and_restores_handler(ckdir):
    before = signal.getsignal(signal.SIGTERM)
    hook = CheckpointHook(ckdir, every_steps=100, on_preemption="raise")
    assert signal.getsignal(signal.SIGTERM) != before
    assert hook(1, _tree(1)) is False
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Preempted) as e:
        hook(2, _tree(2))
    assert e.value.step == 2 and hook.should_stop
    assert hook.manager.all_steps() == [2]       # committed before the exception
    assert hook(3, _tree(3)) is False             # handled once: a loop that goes on is not re-saved
    hook.close()
    assert signal.getsignal(signal.SIGTERM) == before
    assert_tree_equal(cc.CheckpointManager(ckdir, read_only=True).restore(2), _tree(2))


def test_a_read_only_or_closed_manager_is_refused_when_the_hook_is_built_not_at_its_first_save(ckdir):
    """The hook took it and trained on: the first scheduled save (after every_steps steps) raised
    'save on a closed or read-only CheckpointManager'."""
    with cc.CheckpointManager(ckdir) as m:
        m.save(1, _tree(1))
    for m in (cc.CheckpointManager(ckdir, read_only=True), m):
        with pytest.raises(cc.ConfigError, match="read-only|closed"):
            CheckpointHook(m, every_steps=1000, preemption_signals=())
    with cc.CheckpointManager(ckdir) as m, CheckpointHook(m, every_steps=2, preemption_signals=()) as hook:
        assert hook.restore_or_init(_tree(0))[1] == 1
        assert hook(2, _tree(2)) is True
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [1, 2]


def test_a_manager_passed_in_without_a_schedule_saves_every_save_interval_steps_of_it(ckdir):
    """CheckpointHook(CheckpointManager(d, save_interval_steps=5)) saved every step: the hook's
    default schedule ignored the interval the manager was given. A schedule given still decides."""
    with cc.CheckpointManager(ckdir, save_interval_steps=np.int64(5)) as m:
        with CheckpointHook(m, preemption_signals=()) as hook:
            assert [s for s in range(1, 12) if hook(s, _tree(s))] == [5, 10]
        with CheckpointHook(m, every_steps=4, preemption_signals=()) as hook:
            assert [s for s in range(12, 17) if hook(s, _tree(s))] == [12, 16]
        assert m.all_steps() == [5, 10, 12, 16]


@pytest.mark.parametrize("signals", [signal.SIGTERM, "SIGTERM", (signal.SIGUSR1, signal.SIGKILL), (99999,),
                                     ("SIGTERM",), (True,)])
def test_preemption_signals_that_cannot_be_watched_are_refused_before_anything_is_installed(ckdir, signals):
    """They raised TypeError / ValueError / OSError, after the hook had opened (and locked) its
    directory, and (SIGUSR1, SIGKILL) left SIGUSR1 handled by a watcher nobody held: the process no
    longer died on SIGUSR1. Now a ConfigError naming the argument, nothing installed nor opened."""
    from ckpt_callbacks.preemption import PreemptionWatcher
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.raises(cc.ConfigError, match="preemption_signals"):
        CheckpointHook(ckdir, preemption_signals=signals)
    assert not os.path.exists(ckdir)
    with pytest.raises(OSError):   # the watcher alone: what it installed before failing is put back
        PreemptionWatcher((signal.SIGUSR1, signal.SIGKILL))
    assert {s: signal.getsignal(s) for s in before} == before
    with CheckpointHook(ckdir, preemption_signals=[signal.SIGUSR1], every_steps=10) as hook:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert hook(1, _tree(1)) is True and hook.should_stop
    assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]


def test_a_signal_listed_twice_is_watched_once(ckdir):
    """preemption_signals=(SIGTERM, SIGTERM): the second install recorded the watcher's own handler
    as the previous one, so SIGTERM made the handler call itself until RecursionError (raised into
    the training loop), and close() left it installed: SIGTERM was swallowed for good."""
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointHook(ckdir, every_steps=10, preemption_signals=(signal.SIGTERM, signal.SIGTERM)) as hook:
        os.kill(os.getpid(), signal.SIGTERM)
        assert hook(1, _tree(1)) is True and hook.should_stop
    assert signal.getsignal(signal.SIGTERM) == before


def test_two_hooks_at_once_both_save_on_sigterm_and_closing_them_in_any_order_puts_the_handler_back(ckdir):
    """The newer hook's handler replaced the older one's: only it saved the preemption step (the
    other lost it), and closing the older first left a closed hook's handler swallowing SIGTERM."""
    before = signal.getsignal(signal.SIGTERM)
    full, params = CheckpointHook(ckdir + "-full", every_steps=100), CheckpointHook(ckdir + "-params", every_steps=100)
    full(1, _tree(1)), params(1, _tree(1))
    os.kill(os.getpid(), signal.SIGTERM)
    assert full(2, _tree(2)) and params(2, _tree(2))
    assert full.should_stop and params.should_stop
    assert full.manager.all_steps() == params.manager.all_steps() == [2]
    full.close()
    params.close()
    assert signal.getsignal(signal.SIGTERM) == before
    a, b, c = (CheckpointHook(f"{ckdir}-{i}", every_steps=100) for i in range(3))
    b.close()   # the middle one first: a signal still reaches the other two
    os.kill(os.getpid(), signal.SIGTERM)
    assert a._watcher.requested and c._watcher.requested
    c.close()
    a.close()
    assert signal.getsignal(signal.SIGTERM) == before


class _Iter:
    """A minimal get_state/set_state iterator (not Grain): any such object works."""

    def __init__(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        return self.i

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def test_a_damaged_data_position_is_refused_and_fallback_resumes_from_the_step_before(ckdir):
    it = _Iter()
    hook = CheckpointHook(ckdir, every_steps=1, data_iterator=it, preemption_signals=())
    for step in (1, 2):
        next(it)
        hook(step, _tree(step))
    hook.close()
    host = os.path.join(ckdir, "step_0000000002", "host", "p0.msgpack")
    data = bytearray(open(host, "rb").read())
    data[-1] ^= 1   # still valid msgpack: another position
    open(host, "wb").write(bytes(data))
    it = _Iter()
    hook = CheckpointHook(ckdir, every_steps=1, preemption_signals=())
    with pytest.raises(cc.CorruptCheckpointError, match=r"step 2 in .* is damaged: host state (.|\n)*fallback=True"):
        hook.restore_or_init(_tree(0), data_iterator=it)
    assert it.i == 0
    state, start = hook.restore_or_init(_tree(0), data_iterator=it, fallback=True)
    assert start == 1 and it.i == 1
    assert_tree_equal(state, _tree(1))
    hook.close()


def test_data_iterator_from_constructor_and_missing_state_is_an_error(ckdir, caplog):
    it = _Iter()
    hook = CheckpointHook(ckdir, every_steps=2, data_iterator=it, preemption_signals=())
    for step in range(1, 5):
        next(it)
        hook(step, _tree(step))
    hook.close()
    it2 = _Iter()
    hook = CheckpointHook(ckdir, preemption_signals=())
    tree, start = hook.restore_or_init(_tree(0), data_iterator=it2)
    assert start == 4 and it2.i == 4 and next(it2) == 5
    hook.close()
    hook = CheckpointHook(ckdir, preemption_signals=())   # the position saved, no iterator given: said
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        assert hook.restore_or_init(_tree(0))[1] == 4
    assert any("got no data_iterator" in r.getMessage() for r in caplog.records)
    hook.close()

    other = ckdir + "-noiter"
    with cc.CheckpointManager(other) as m:
        m.save(3, _tree(3))
    hook = CheckpointHook(other, preemption_signals=())
    with pytest.raises(cc.IncompatibleCheckpointError, match="data-iterator state"):
        hook.restore_or_init(_tree(0), data_iterator=_Iter())
    hook.close()


def test_an_iterator_remap_that_returns_the_iterator_state_alone_or_maps_badly_is_named(ckdir):
    """fn(saved, i, n) -> saved[0]["data_iterator"] (the iterator's state, not the host state) raised
    'step 2 holds no data-iterator state for process 0 ... resume from a checkpoint saved with one':
    the step holds one. A bad dict mapping was named 'remap', an argument the hook does not have."""
    it = _Iter()
    with CheckpointHook(ckdir, every_steps=2, data_iterator=it, preemption_signals=()) as hook:
        for step in (1, 2):
            next(it)
            hook(step, _tree(step))
    with CheckpointHook(ckdir, every_steps=2, preemption_signals=()) as hook:
        with pytest.raises(cc.ConfigError, match=r"iterator_remap returned \{'i': 2\} for process 0"):
            hook.restore_or_init(_tree(0), _Iter(), iterator_remap=lambda saved, i, n: saved[0]["data_iterator"])
        with pytest.raises(cc.ConfigError, match=r"iterator_remap: remap\[0\]=1"):
            hook.restore_or_init(_tree(0), _Iter(), iterator_remap={0: 1})
        it = _Iter()
        assert hook.restore_or_init(_tree(0), it, iterator_remap=lambda saved, i, n: saved[0])[1] == 2
        assert it.i == 2


def test_a_restore_refused_for_its_data_iterator_can_be_retried_without_it(ckdir):
    """Refused ('holds no data-iterator state ... Fix: restore without data_iterator='), the
    retry restore_or_init(state) on the same hook was refused again: the refused call had kept
    the iterator as the hook's own."""
    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        hook(1, _tree(1))
    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        with pytest.raises(cc.IncompatibleCheckpointError, match="holds no data-iterator state"):
            hook.restore_or_init(_tree(0), data_iterator=_Iter())
        state, start = hook.restore_or_init(_tree(0))
        assert start == 1 and hook.data_iterator is None
        assert_tree_equal(state, _tree(1))


def test_a_data_iterator_that_cannot_report_its_position_is_refused_up_front(ckdir):
    """A plain iterator was accepted and training died at the first save (an AttributeError, after
    `every_steps` steps of work): refused where it is given, nothing created."""
    with pytest.raises(cc.ConfigError, match=r"data_iterator: range_iterator has no get_state\(\) or set_state\(\)"):
        CheckpointHook(ckdir, data_iterator=iter(range(3)), preemption_signals=())
    assert not os.path.exists(ckdir)

    class OnlyGet:
        def get_state(self):
            return {}
    hook = CheckpointHook(ckdir, every_steps=1, preemption_signals=())
    with pytest.raises(cc.ConfigError, match=r"OnlyGet has no set_state\(\)"):
        hook.restore_or_init(_tree(0), data_iterator=OnlyGet())
    assert hook.data_iterator is None and hook(1, _tree(1))
    hook.close()


def test_nnx_objects_beside_plain_values_are_saved_and_restored_all(ckdir):
    """``nnx.state`` of ``{"model": m, "step": 7}`` drops the Python number, and ``nnx.update``
    cannot set a tuple's elements: such containers were saved without those values (no error),
    and a tuple of a model and a key failed to restore with flax's ValueError."""
    lin = lambda seed: nnx.Linear(2, 2, rngs=nnx.Rngs(seed))
    m = lin(0)
    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        hook(1, {"model": m, "step": 7, "lr": 0.5, "ema": {"w": jnp.full((2,), 3.0)}})
        hook(2, (m, jax.random.key(5), 9))
        hook.wait_until_finished()
        assert sorted(hook.manager.restore(1)) == ["ema", "lr", "model", "step"]
    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        fresh = lin(1)
        (got, key, n), start = hook.restore_or_init((fresh, jax.random.key(0), 0))
        assert start == 2 and got is fresh and n == 9
        assert_tree_equal(_host(nnx.state(got)), _host(nnx.state(m)))
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(5)))
        target = {"model": lin(2), "step": 0, "lr": 0.0, "ema": {"w": jnp.zeros(2)}}
        from ckpt_callbacks.flax import put_back, state_tree
        back = put_back(target, hook.manager.restore(1, target=state_tree(target)))
        assert back["model"] is target["model"] and (back["step"], back["lr"]) == (7, 0.5)
        np.testing.assert_array_equal(back["ema"]["w"], np.full((2,), 3.0))


def test_linen_trainstate_roundtrip_in_process(ckdir):
    import flax.linen as nn
    from flax.training import train_state

    m = nn.Dense(4)
    params = m.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    tx = optax.sgd(0.1, momentum=0.9)
    st = train_state.TrainState.create(apply_fn=m.apply, params=params, tx=tx)
    grads = jax.tree_util.tree_map(jnp.ones_like, st.params)
    st = st.apply_gradients(grads=grads)
    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        assert hook(1, st)
    fresh = train_state.TrainState.create(apply_fn=m.apply, params=jax.tree_util.tree_map(jnp.zeros_like, params),
                                          tx=tx)
    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        got, start = hook.restore_or_init(fresh)
    assert start == 1 and isinstance(got, train_state.TrainState) and got.apply_fn == m.apply
    assert_tree_equal(_host(got), _host(st))


def test_a_sharded_linen_state_with_adam_trains_on_after_a_resume(ckdir, devices):
    """Params sharded over a 4x2 mesh, adam's `count` left where jax put it (uncommitted): the
    first step after restore_or_init runs, as in the fresh run (it failed with "incompatible
    devices" when the restore pinned `count` to device 0)."""
    import flax.linen as nn
    from flax.training import train_state

    mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    m = nn.Dense(8)
    params = m.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    params = {"kernel": jax.device_put(params["kernel"], jax.sharding.NamedSharding(mesh, P("a", "b"))),
              "bias": jax.device_put(params["bias"], jax.sharding.NamedSharding(mesh, P("b")))}
    x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(mesh, P("a")))

    @jax.jit
    def step(st):
        grads = jax.grad(lambda p: jnp.sum(st.apply_fn({"params": p}, x) ** 2))(st.params)
        return st.apply_gradients(grads=grads)

    def fresh():
        return train_state.TrainState.create(apply_fn=m.apply, params=params, tx=optax.adam(1e-2))

    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        st, start = hook.restore_or_init(fresh())
        assert start == 0 and not st.opt_state[0].count.committed
        st = step(st)
        assert hook(1, st)
    with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
        st2, start = hook.restore_or_init(fresh())
    assert start == 1 and not st2.opt_state[0].count.committed
    a, b = step(st2), step(st)
    assert_tree_equal(_host((a.step, a.params, a.opt_state)), _host((b.step, b.params, b.opt_state)))


def _doc_blocks():
    text = open(os.path.join(HERE, "..", "docs", "flax.md")).read()
    blocks = text.split("```python\n")[1:]
    return [b.split("```")[0] for b in blocks if "CKPT_DIR = " in b]


@pytest.mark.parametrize("which", ["nnx", "linen"])
def test_docs_copy_paste_loops_run_and_resume(tmp_path, which):
    nnx_code, linen_code = _doc_blocks()
    code = nnx_code if which == "nnx" else linen_code
    d = str(tmp_path / "ckpt")
    code = code.replace(f'CKPT_DIR = "/tmp/flax-{which}-run"', f"CKPT_DIR = {d!r}")
    assert d in code
    script = tmp_path / "loop.py"
    script.write_text(code)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    outs = [p.stdout]
    assert "starting at step 0" in outs[0]
    if which == "nnx":       # the same script run again finds step 30 committed: nothing to do
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0 and "starting at step 30" in p.stdout, p.stdout + p.stderr
    kept = [line for line in outs[0].splitlines() if "kept:" in line][0]
    if which == "nnx":   # eval steps 5, 10, ..., 30 are saved: KeepLast(2) keeps 25 and 30, plus the best
        with cc.CheckpointManager(d, read_only=True, retention=cc.KeepBest("val_loss", "min")) as m:
            best = m.best_step()
        assert kept.endswith(str(sorted({25, 30, best})))
    else:
        assert kept.endswith("[10, 20, 30]")


def test_save_of_a_step_saved_or_being_saved_is_a_quiet_no_op(ckdir, caplog):
    # the docs' loops end with hook.save(last_step, ...) after hook(last_step, ...) may have saved it
    hook = CheckpointHook(ckdir, every_steps=10, preemption_signals=())
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        for step in range(1, 11):
            hook(step, _tree(step))
        assert hook.save(10, _tree(10)) is False          # still being written
        hook.wait_until_finished()
        assert hook.save(10, _tree(10)) is False          # committed
        assert hook.save(11, _tree(11)) is True           # off the schedule: saved
    hook.close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [10, 11]


def test_saving_an_earlier_step_of_this_run_again_is_quiet(ckdir, caplog):
    """hook.save of a step this run committed, below the run's own latest: skipped without the
    manager's "below an earlier run's latest step" warning (this run saved that latest step)."""
    hook = CheckpointHook(ckdir, on_steps=[5, 8], preemption_signals=())
    state, start = hook.restore_or_init(_tree(0))
    assert start == 0
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        for step in range(1, 9):
            hook(step, _tree(step))
        hook.wait_until_finished()
        assert hook.save(5, _tree(5)) is False
    hook.close()
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [5, 8]


@pytest.mark.parametrize("on_steps", [5, "100", 2.5, np.array(5)])
def test_on_steps_must_be_a_collection_of_steps(ckdir, on_steps):
    with pytest.raises(cc.ConfigError, match="on_steps"):
        CheckpointHook(ckdir, on_steps=on_steps, preemption_signals=())


def test_on_steps_as_a_long_range_is_taken_at_once_and_checked_at_both_ends(ckdir):
    """A range was expanded into a set of every step first: 10 million steps took ~20 s and 1 GiB."""
    import time
    t = time.perf_counter()
    with CheckpointHook(ckdir, on_steps=range(100, 10**9, 100), save_on_eval=False, preemption_signals=()) as hook:
        assert time.perf_counter() - t < 5
        assert [hook(s, _tree(s)) for s in (99, 100, 150, 200)] == [False, True, False, True]
    with pytest.raises(cc.ConfigError, match="on_steps"):
        CheckpointHook(ckdir, on_steps=range(0, 10**12, 1000), preemption_signals=())
    with pytest.raises(cc.ConfigError, match="on_steps"):
        CheckpointHook(ckdir, on_steps=range(-5, 100, 10), preemption_signals=())


def test_an_empty_on_steps_schedules_no_step(ckdir):
    """It saved every step (as if no schedule were given). As CLU's: no step is scheduled; eval steps
    still save; beside another schedule it adds nothing; with save_on_eval=False nothing would be saved."""
    with CheckpointHook(ckdir, on_steps=[], preemption_signals=()) as hook:
        assert [s for s in range(1, 10) if hook(s, _tree(s), metrics={"loss": 1.0} if s == 6 else None)] == [6]
    with CheckpointHook(ckdir + "2", every_steps=4, on_steps=(), preemption_signals=()) as hook:
        assert [s for s in range(1, 10) if hook(s, _tree(s))] == [4, 8]
    with pytest.raises(cc.ConfigError, match="nothing would be saved but on preemption"):
        CheckpointHook(ckdir + "3", on_steps=[], save_on_eval=False, preemption_signals=())


@pytest.mark.parametrize("step", [True, np.bool_(False), 3.0, "3", np.float32(3), -1, 10**10, np.uint64(2**63 + 1)])
def test_a_step_that_is_not_a_count_of_steps_is_refused_as_the_manager_refuses_it(ckdir, step):
    """A bool was taken for step 1 (or 0) by the hook, which the manager's save refuses."""
    hook = CheckpointHook(ckdir, every_steps=1, preemption_signals=())
    for call in (lambda: hook(step, _tree(1)), lambda: hook.save(step, _tree(1)),
                 lambda: hook.report_eval(step, {"loss": 1.0}), lambda: CheckpointHook(ckdir, on_steps=[step])):
        with pytest.raises(cc.ConfigError, match="step"):
            call()
    hook(jnp.asarray(3, jnp.int32), _tree(3))   # a TrainState's step counter is an int
    hook.close()
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [3]


@pytest.mark.parametrize("kw", [{"save_on_eval": "false"}, {"save_on_eval": 0}, {"clock": 5.0}])
def test_save_on_eval_and_clock_are_checked_when_the_hook_is_built(ckdir, kw):
    """save_on_eval="false" (a config's string) was taken as True, and saved every eval step;
    clock=5.0 raised TypeError "'float' object is not callable"."""
    with pytest.raises(cc.ConfigError, match=next(iter(kw))):
        CheckpointHook(ckdir, every_steps=10, preemption_signals=(), **kw)
    assert not os.path.exists(ckdir)


def test_schedule_numbers_are_checked_alike_numpy_or_not(ckdir):
    hook = CheckpointHook(ckdir, every_steps=np.int64(4), every_secs=np.float32(60), preemption_signals=())
    assert (hook.every_steps, hook.every_secs) == (4, 60.0) and type(hook.every_steps) is int
    hook.close()
    for kw in ({"every_secs": float("nan")}, {"every_secs": float("inf")}, {"every_steps": 2.0},
               {"every_steps": True}, {"every_secs": "60"}, {"every_steps": 0}):
        with pytest.raises(cc.ConfigError, match=next(iter(kw))):
            CheckpointHook(ckdir, preemption_signals=(), **kw)
    with cc.CheckpointManager(ckdir) as m:
        with pytest.raises(cc.ConfigError, match="async_save="):
            CheckpointHook(m, async_save=False, preemption_signals=())
        with pytest.raises(cc.ConfigError, match="timeout_s="):
            CheckpointHook(m, timeout_s=30, preemption_signals=())
    for bad in (0, "60", float("inf"), True):
        with pytest.raises(cc.ConfigError, match="timeout_s must be a positive number"):
            CheckpointHook(ckdir, timeout_s=bad, preemption_signals=())


def test_a_step_going_backwards_is_warned_about_once(ckdir, caplog):
    hook = CheckpointHook(ckdir, every_steps=2, preemption_signals=())
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        for step in (1, 2, 3, 4, 1, 2, 3):   # a step counted within the epoch
            hook(step, _tree(step))
    hook.close()
    warned = [r.getMessage() for r in caplog.records if "after step" in r.getMessage()]
    assert len(warned) == 1 and "got step 1 after step 4" in warned[0]


def test_restore_or_init_falls_back_past_a_damaged_latest_step_when_asked(ckdir):
    hook = CheckpointHook(ckdir, every_steps=1, preemption_signals=())
    for step in (1, 2):
        hook(step, _tree(step))
    hook.close()
    blob = os.path.join(ckdir, "step_0000000002", "blobs", "p0-0.msgpack")
    data = bytearray(open(blob, "rb").read())
    data[-3] ^= 0xFF
    open(blob, "wb").write(bytes(data))
    hook = CheckpointHook(ckdir, every_steps=1, preemption_signals=())
    with pytest.raises(cc.CorruptCheckpointError, match=r"step 2 in .* is damaged(.|\n)*fallback=True"):
        hook.restore_or_init(_tree(0))
    state, start = hook.restore_or_init(_tree(0), fallback=True)
    assert start == 1
    assert_tree_equal(state, _tree(1))
    for step in (2, 3):   # the run goes on: step 2 is saved anew, over the damaged one
        hook(step, _tree(step))
    hook.close()
    m = cc.CheckpointManager(ckdir, read_only=True)
    assert m.all_steps() == [1, 2, 3]
    assert_tree_equal(m.restore(2), _tree(2))


def test_a_preemption_after_a_fallback_keeps_the_step_it_saved_below_the_damaged_one(ckdir, caplog):
    """Step 6 damaged, the run resumes from 4 (fallback; now with KeepLast(1)) and is preempted at
    5: step 5 is saved and kept, and the rerun resumes from it. Retention counted the damaged step 6 as the
    last one: it deleted 4 and 5 as soon as 5 committed, leaving no intact step to resume from, and
    the manager warned 'restore() first' to a run that had restored."""
    with CheckpointHook(ckdir, every_steps=2, retention=cc.KeepLast(2), preemption_signals=()) as hook:
        for step in range(1, 7):
            hook(step, _tree(step))
    blob = os.path.join(ckdir, "step_0000000006", "blobs", "p0-0.msgpack")
    data = bytearray(open(blob, "rb").read())
    data[-3] ^= 0xFF
    open(blob, "wb").write(bytes(data))
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        with CheckpointHook(ckdir, every_steps=2, retention=cc.KeepLast(1)) as hook:
            _, start = hook.restore_or_init(_tree(0), fallback=True)
            assert start == 4
            os.kill(os.getpid(), signal.SIGTERM)
            assert hook(5, _tree(5)) is True and hook.should_stop
            hook.wait_until_finished()
            assert hook.manager.all_steps() == [5, 6]   # 6: damaged, kept until saved anew
    assert not [r for r in caplog.records if "below the latest" in r.getMessage()]
    # (it said 'step 6 is committed', the damaged step, not the one it saved)
    assert [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()][0].startswith(
        "ckpt_callbacks: preempted (SIGTERM): step 5 is committed")
    with CheckpointHook(ckdir, every_steps=2, retention=cc.KeepLast(1), preemption_signals=()) as hook:
        state, start = hook.restore_or_init(_tree(0), fallback=True)
        assert start == 5
        assert_tree_equal(state, _tree(5))
        hook(6, _tree(6))   # saved anew over the damaged one; retention then keeps it alone
    with cc.CheckpointManager(ckdir, read_only=True) as m:
        assert m.all_steps() == [6]
        assert_tree_equal(m.restore(6), _tree(6))


def test_a_rerun_that_does_not_restore_is_told_that_it_saves_below_the_earlier_run(ckdir, caplog):
    """A second run in the same directory without `restore_or_init`: its schedule reaches steps the
    first run committed, which the hook skips without a word, and saves steps below the first
    run's latest, which KeepLast deletes at once. The manager says so, once."""
    with CheckpointHook(ckdir, every_steps=5, preemption_signals=()) as hook:
        for step in range(1, 11):
            hook(step, _tree(step))
    with caplog.at_level("WARNING", "ckpt_callbacks"):
        with CheckpointHook(ckdir, every_steps=5, preemption_signals=()) as hook:
            assert [s for s in range(1, 13) if hook(s, _tree(s))] == []   # 5 and 10: committed already
            assert hook.save(12, _tree(12)) is True
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "step 5 below the latest committed step 10" in said[0], said
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [5, 10, 12]


def test_a_with_block_that_raises_keeps_its_exception_when_the_last_save_failed(ckdir, monkeypatch):
    """As the manager's: the hook's `with` leaves with the body's exception, the failed save noted on it."""
    import ckpt_callbacks.manager as mm

    def full(*a, **k):
        raise OSError(28, "No space left on device (simulated)")
    monkeypatch.setattr(mm, "write_and_commit", full)
    with pytest.raises(RuntimeError, match="diverged") as e:
        with CheckpointHook(ckdir, every_steps=1, preemption_signals=()) as hook:
            assert hook(1, {"w": np.ones(3)})
            raise RuntimeError("diverged")
    assert any("No space left" in n for n in e.value.__notes__)


def _fail_writes(monkeypatch):
    """Make every save's background write fail (as a full disk does); returns the undo."""
    import ckpt_callbacks.manager as mm
    real = mm.write_and_commit

    def full(*a, **k):
        raise OSError(28, "No space left on device (simulated)")
    monkeypatch.setattr(mm, "write_and_commit", full)
    return lambda: monkeypatch.setattr(mm, "write_and_commit", real)


def test_save_of_a_step_whose_save_failed_saves_it_again(ckdir, monkeypatch):
    """The docs' final ``hook.save(step, state)`` after the schedule's save of that step failed
    (and the failure was raised): it saves the step (it returned False for good)."""
    hook = CheckpointHook(ckdir, every_steps=5, preemption_signals=())
    hook(5, _tree(5))
    hook.wait_until_finished()
    undo = _fail_writes(monkeypatch)
    assert hook(10, _tree(10)) is True
    with pytest.raises(OSError, match="No space left"):
        hook.wait_until_finished()
    undo()
    assert hook.save(10, _tree(10)) is True
    hook.save(10, _tree(10))          # in flight or committed: no second save, no error
    hook.close()
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [5, 10]


def test_a_failed_preemption_save_leaves_the_request_standing(ckdir, monkeypatch):
    """SIGTERM, and the preemption save fails: the failure is raised, and the next call saves for
    the preemption again (the request had been cleared before the save's outcome was known)."""
    hook = CheckpointHook(ckdir, every_steps=100, preemption_signals=(signal.SIGTERM,))
    undo = _fail_writes(monkeypatch)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(OSError, match="No space left"):
        hook(6, _tree(6))
    assert not hook.should_stop
    undo()
    assert hook(7, _tree(7)) is True and hook.should_stop
    hook.close()
    assert cc.CheckpointManager(ckdir, read_only=True).all_steps() == [7]
