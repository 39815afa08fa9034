"""How processes agree: barriers and small messages over JAX's coordination service.

Example::

    from ckpt_callbacks.coordination import current
    coord = current().scoped("my-run")   # SingleProcess() unless jax.distributed is initialized
    coord.barrier("ready", timeout_s=60)
    token = coord.broadcast("token", b"abc" if coord.process_index == 0 else None, timeout_s=60)

Every process of a run calls the same methods with the same names in the same order (SPMD). A
name is used once per scope: a barrier or message name must be identical on every process and never
reused (the key-value store keeps keys; a reused key would deliver a stale value). A barrier,
gather or broadcast that does not complete within its timeout raises `CoordinationTimeoutError` (a
`CheckpointSaveError`) naming the operation, so a dead peer never hangs the survivors. No device
collective is used: these go through the `jax.distributed` key-value store and barriers, which have
timeouts.

Who calls what: `CheckpointManager` takes `current()` once, scopes it with `for_directory` (one
scope per manager instance and directory, numbered in construction order on each process), and
derives every name from that scope plus a per-save token. When the coordinator process (process 0,
which hosts JAX's coordination service) dies, JAX itself terminates the other processes (its
fail-fast policy); when another process dies, the survivors' waits time out and raise.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time

import jax

from .errors import CheckpointSaveError

__all__ = ["Coordinator", "SingleProcess", "JaxDistributed", "CoordinationTimeoutError", "current",
           "for_directory", "for_collective_read", "agree_round"]


class CoordinationTimeoutError(CheckpointSaveError):
    """A cross-process wait did not complete in time: a peer died, is stuck, or diverged (SPMD)."""


class Coordinator:
    """The interface. ``process_index``/``process_count`` describe this run; names are per scope."""

    process_index: int = 0
    process_count: int = 1

    def scoped(self, name: str) -> "Coordinator":
        """A coordinator whose names live under `name` (same processes)."""
        raise NotImplementedError

    def barrier(self, name: str, timeout_s: float) -> None:
        raise NotImplementedError

    def all_gather(self, name: str, data: bytes, timeout_s: float) -> list[bytes]:
        """Every process contributes bytes; every process gets the list ordered by process index."""
        raise NotImplementedError

    def broadcast(self, name: str, data: bytes | None, timeout_s: float) -> bytes:
        """Process 0's bytes, delivered to every process (others pass None)."""
        raise NotImplementedError

    def forget(self, name: str) -> None:
        """Drop this process's part of the `all_gather` `name`, which no process reads again."""


def agree_round(coord: Coordinator, prefix: str, n: int, data: bytes, timeout_s: float) -> list[bytes]:
    """Round `n` (1, 2, ...) of a sequence of `all_gather`s named ``prefix + str(n)`` that one thread
    of each process runs in order (the hooks' per-step agreements): once it is complete here, this
    process's part of round n-1 is dropped, so that the coordination service's store does not grow
    with every step of a run. Safe: a process sends its part of round n only after it has read all
    of round n-1, so once this process has every part of round n, nobody reads round n-1 again."""
    got = coord.all_gather(f"{prefix}{n}", data, timeout_s)
    if n > 1:
        coord.forget(f"{prefix}{n - 1}")
    return got


class SingleProcess(Coordinator):
    def scoped(self, name):
        return self

    def barrier(self, name, timeout_s):
        pass

    def all_gather(self, name, data, timeout_s):
        return [data]

    def broadcast(self, name, data, timeout_s):
        return data


class JaxDistributed(Coordinator):
    """Coordination through the `jax.distributed` client (its key-value store and barriers)."""

    def __init__(self, client, process_index: int, process_count: int, namespace: str = "ckpt_callbacks"):
        self.client, self.process_index, self.process_count = client, process_index, process_count
        self.namespace = namespace

    def scoped(self, name):
        return JaxDistributed(self.client, self.process_index, self.process_count, f"{self.namespace}/{name}")

    def _key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def _fail(self, what: str, timeout_s: float, e: Exception, peers=(), t0: float | None = None):
        """Raise CoordinationTimeoutError; `peers` (or a function giving them, asked only on a
        timeout) are the processes that sent nothing."""
        said = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        waited = None if t0 is None else time.monotonic() - t0
        # a deadline that another process's wait ran out already, or a full wait here: a timeout;
        # a call refused at once, or one that never waits (publishing): the service is gone
        timed_out = "DEADLINE_EXCEEDED" in said or (waited is not None and waited >= 0.9 * timeout_s)
        if not timed_out:
            after = "" if waited is None else f" after {waited:.1f}s"
            who = {self.process_index: f"{what} failed{after}: {said}"}
            raise CoordinationTimeoutError(
                f"process {self.process_index}/{self.process_count}: {what} failed{after}: the "
                f"coordination service (hosted by process 0) is gone or refused it, e.g. process 0 "
                f"died. Coordination service said: {said}", who) from None
        who = {self.process_index: f"timeout in {what}"}
        peers = peers() if callable(peers) else peers
        for p in peers:
            who[p] = f"sent nothing within {timeout_s:g}s (died or stuck)"
        silent = f" (silent: process {', '.join(map(str, peers))})" if peers else ""
        raise CoordinationTimeoutError(
            f"process {self.process_index}/{self.process_count}: {what} did not complete within "
            f"{timeout_s:g}s{silent}: a peer process died, is stuck, or called a different sequence of "
            f"checkpoint operations (every process must call save/restore alike). "
            f"Coordination service said: {said}", who) from None

    def _set(self, name: str, data: bytes, timeout_s: float) -> None:
        try:
            self.client.key_value_set_bytes(self._key(name), data)
        except Exception as e:  # noqa: BLE001 - the service is gone or the key was reused
            self._fail(f"publishing {name!r}", timeout_s, e)

    def _get(self, name: str, what: str, timeout_s: float, peer: int) -> bytes:
        t0 = time.monotonic()
        try:
            return self.client.blocking_key_value_get_bytes(self._key(name), max(1, int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001
            self._fail(what, timeout_s, e, (peer,), t0)

    def barrier(self, name, timeout_s):
        t0 = time.monotonic()
        try:   # each process also says it came, so that a timeout can name those who did not
            self.client.key_value_set_bytes(self._key(f"{name}/at/{self.process_index}"), b"")
            self.client.wait_at_barrier(self._key(name), max(1, int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001
            self._fail(f"barrier {name!r}", timeout_s, e, lambda: self._absent(f"{name}/at/"), t0)

    def _absent(self, prefix: str) -> list:
        """The processes that have not set a key under `prefix` (none known if the service is gone)."""
        try:
            came = {int(k.rsplit("/", 1)[1]) for k, _ in self.client.key_value_dir_get_bytes(self._key(prefix))}
        except Exception:  # noqa: BLE001
            return []
        return [p for p in range(self.process_count) if p not in came]

    def all_gather(self, name, data, timeout_s):
        self._set(f"{name}/{self.process_index}", data, timeout_s)
        return [data if i == self.process_index else
                self._get(f"{name}/{i}", f"gather {name!r} from process {i}", timeout_s, i)
                for i in range(self.process_count)]

    def forget(self, name):
        try:
            self.client.key_value_delete(self._key(f"{name}/{self.process_index}"))
        except Exception:  # noqa: BLE001 - a key left behind costs a few bytes; the service may be gone
            pass

    def broadcast(self, name, data, timeout_s):
        if self.process_index == 0:
            self._set(name, data, timeout_s)
            return data
        return self._get(name, f"broadcast {name!r} from process 0", timeout_s, 0)


def current() -> Coordinator:
    """JaxDistributed when `jax.distributed.initialize` ran in this process, else SingleProcess."""
    from jax._src import distributed  # the public API exposes no accessor for the client

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return SingleProcess()
    return JaxDistributed(client, jax.process_index(), jax.process_count())


_instances: dict = {}
_instances_lock = threading.Lock()


def for_directory(coord: Coordinator, url: str) -> Coordinator:
    """`coord` scoped to the n-th manager of `url` created by this process (n counts from 0).

    Every process creates its managers for a directory in the same order, so the n-th one gets
    the same scope everywhere, and a second manager of the same directory never meets the first
    one's keys.
    """
    if coord.process_count == 1:
        return coord
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    with _instances_lock:
        counter = _instances.setdefault(digest, itertools.count())
        n = next(counter)
    return coord.scoped(f"dir-{digest}/{n}")


def for_collective_read(coord: Coordinator, url: str) -> Coordinator:
    """`coord` scoped to the n-th collective restore of `url` through a read-only manager in this
    process (n counts from 0).

    A read-only manager takes no scope when it is made (one process alone may open one, to look);
    a restore onto arrays that span several processes is collective (every process must call it
    to build them), so every process counts these alike, whichever managers make them.
    """
    if coord.process_count == 1:
        return coord
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    with _instances_lock:
        counter = _instances.setdefault(("read", digest), itertools.count())
        n = next(counter)
    return coord.scoped(f"read-{digest}/{n}")
