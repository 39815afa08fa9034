"""Run a Python function in N real `jax.distributed` processes on 127.0.0.1 (test helper).

Example::

    from multiproc import launch
    results = launch("multihost_worker:hello", nprocs=2, devices_per_process=4, args={"x": 1})
    assert [r.result for r in results] == [...]          # one Result per process, by process index
    results.raise_if_failed()                            # AssertionError with every traceback

Who calls what: a test calls `launch` in the pytest process. It picks a free port and starts
`python tests/multiproc.py CONFIG` once per process. Each child sets its CPU device count
(``jax_num_cpu_devices``), CPU-only platforms and gloo CPU collectives *before* touching a device,
calls `jax.distributed.initialize` (process 0 hosts the coordination service), imports the
target ``"module:function"`` (from tests/ or the repo) and calls ``function(**args)``. `args` and
the return value travel as JSON (never pickle). The child writes its result (or the exception's
type, message and traceback) to a file, waits at a final barrier so process 0 (which hosts the
service) does not leave while its peers still need it, then exits without the shutdown dance
(``os._exit``), so a test in which a peer dies never hangs at exit.

`launch` returns when every process has exited or written its result; stragglers that already
reported are killed after a grace period; on the overall timeout every child is killed and the
results say so. A process that dies on purpose (``os._exit(code)`` in the target) shows up as a
Result with that ``returncode`` and no ``result``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["launch", "Result", "Results", "free_port"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Result:
    process_index: int
    returncode: int | None       # None: killed by `launch` after reporting (or at the timeout)
    ok: bool                     # the target returned normally
    result: object = None        # its JSON return value
    error: str | None = None     # "ExceptionType: message" when it raised
    error_type: str | None = None
    traceback: str | None = None
    output: str = ""             # the tail of the child's stdout+stderr
    wall_s: float = 0.0          # seconds from start to its report (or exit)

    def describe(self) -> str:
        head = f"process {self.process_index}: rc={self.returncode} ok={self.ok}"
        if self.error:
            head += f"\n{self.traceback or self.error}"
        return f"{head}\n--- output tail ---\n{self.output[-3000:]}"


class Results(list):
    """A list of Result ordered by process index, with a helper to fail loudly."""

    def raise_if_failed(self) -> "Results":
        bad = [r for r in self if not r.ok]
        if bad:
            raise AssertionError("multi-process run failed:\n" + "\n\n".join(r.describe() for r in bad))
        return self

    @property
    def values(self) -> list:
        return [r.result for r in self]


def launch(target: str, nprocs: int, *, devices_per_process: int = 4, args: dict | None = None,
           per_process_args: list[dict] | None = None, timeout_s: float = 120.0,
           grace_s: float = 20.0, env: dict | None = None) -> Results:
    """Run ``target(**args)`` ("module:function") in `nprocs` jax.distributed processes.

    `per_process_args[i]` is merged over `args` for process i. Returns one Result per process.
    """
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="multiproc-")
    child_env = dict(os.environ)
    child_env.pop("XLA_FLAGS", None)
    child_env["JAX_PLATFORMS"] = "cpu"
    child_env["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, child_env.get("PYTHONPATH", "")])
    child_env.update(env or {})
    procs, outs, logs = [], [], []
    t0 = time.monotonic()
    for i in range(nprocs):
        a = dict(args or {})
        a.update((per_process_args or [{}] * nprocs)[i])
        cfg = {"target": target, "process_id": i, "nprocs": nprocs, "port": port,
               "devices": devices_per_process, "args": a, "out": os.path.join(tmp, f"result{i}.json"),
               "exit_barrier_s": grace_s}
        cfg_path = os.path.join(tmp, f"config{i}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        log = open(os.path.join(tmp, f"log{i}.txt"), "w+")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), cfg_path], env=child_env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))
        outs.append(cfg["out"])
        logs.append(log)
    reported_at: dict[int, float] = {}
    deadline = t0 + timeout_s
    try:
        while True:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i not in reported_at and (p.poll() is not None or os.path.exists(outs[i])):
                    reported_at[i] = now
            if len(reported_at) == nprocs:
                # everyone reported: let them pass the exit barrier, then kill whoever is left
                # (at once when a peer died without reporting: the barrier cannot complete)
                died = any(p.poll() is not None and not os.path.exists(o) for p, o in zip(procs, outs))
                end = now if died else min(deadline, now + grace_s)
                while time.monotonic() < end and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
                break
            if now > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = Results()
    for i, p in enumerate(procs):
        logs[i].flush()
        logs[i].seek(0)
        output = logs[i].read()[-12000:]
        logs[i].close()
        rc = p.returncode if p.returncode is not None and p.returncode >= 0 else None
        r = Result(i, rc, False, output=output, wall_s=reported_at.get(i, time.monotonic()) - t0)
        try:
            with open(outs[i]) as f:
                rep = json.load(f)
            r.ok, r.result = rep["ok"], rep.get("result")
            r.error, r.error_type, r.traceback = rep.get("error"), rep.get("error_type"), rep.get("traceback")
        except FileNotFoundError:
            r.error = ("timed out" if i not in reported_at else f"exited with code {p.returncode} "
                       f"without reporting")
        results.append(r)
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def _child(cfg_path: str) -> None:
    with open(cfg_path) as f:
        cfg = json.load(f)
    import importlib
    import traceback

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cfg["devices"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", cfg["nprocs"], cfg["process_id"],
                               initialization_timeout=60)
    report: dict
    try:
        mod, fn = cfg["target"].split(":")
        value = getattr(importlib.import_module(mod), fn)(**cfg["args"])
        report = {"ok": True, "result": value}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        report = {"ok": False, "error": f"{type(e).__name__}: {e}", "error_type": type(e).__name__,
                  "traceback": traceback.format_exc()}
    try:
        text = json.dumps(report)
    except (TypeError, ValueError) as e:
        text = json.dumps({"ok": False, "error": f"the return value is not JSON: {e}", "error_type": "TypeError"})
    tmp = cfg["out"] + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, cfg["out"])
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # process 0 hosts the coordination service: leave only when everyone is done with it
        from jax._src import distributed
        distributed.global_state.client.wait_at_barrier("multiproc/exit", int(cfg["exit_barrier_s"] * 1000))
    except Exception:  # noqa: BLE001 - a peer died; the parent collects what there is
        pass
    os._exit(0)


if __name__ == "__main__":
    _child(sys.argv[1])
