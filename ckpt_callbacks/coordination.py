"""How processes agree: barriers and small messages over JAX's coordination service.

Example::

    from ckpt_callbacks.coordination import current
    coord = current()             # SingleProcess() unless jax.distributed is initialized
    coord.barrier("ready", timeout_s=60)

Every process of a run calls the same methods with the same names in the same order (SPMD). A
barrier or gather that does not complete within its timeout raises CheckpointSaveError naming the
operation, so a dead peer never hangs the survivors. No device collective is used: these go through
the `jax.distributed` key-value store, which has timeouts.
"""

from __future__ import annotations

import base64
import itertools

import jax

from .errors import CheckpointSaveError

__all__ = ["Coordinator", "SingleProcess", "JaxDistributed", "current"]


class Coordinator:
    process_index: int = 0
    process_count: int = 1

    def barrier(self, name: str, timeout_s: float) -> None:
        raise NotImplementedError

    def all_gather(self, name: str, data: bytes, timeout_s: float) -> list[bytes]:
        """Every process contributes bytes; every process gets the list ordered by process index."""
        raise NotImplementedError

    def broadcast(self, name: str, data: bytes | None, timeout_s: float) -> bytes:
        """Process 0's bytes, delivered to every process."""
        raise NotImplementedError


class SingleProcess(Coordinator):
    def barrier(self, name, timeout_s):
        pass

    def all_gather(self, name, data, timeout_s):
        return [data]

    def broadcast(self, name, data, timeout_s):
        return data


class JaxDistributed(Coordinator):
    """Coordination through the `jax.distributed` client (its key-value store and barriers)."""

    _ids = itertools.count()

    def __init__(self, client, process_index: int, process_count: int, namespace: str = "ckpt_callbacks"):
        self.client, self.process_index, self.process_count = client, process_index, process_count
        self.namespace = namespace

    def _key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def _fail(self, what: str, timeout_s: float, e: Exception):
        raise CheckpointSaveError(
            f"process {self.process_index}: {what} did not complete within {timeout_s:.0f}s "
            f"(a peer process died or is stuck): {str(e)[:300]}",
            {self.process_index: f"timeout in {what}"}) from None

    def barrier(self, name, timeout_s):
        try:
            self.client.wait_at_barrier(self._key(name), int(timeout_s * 1000))
        except Exception as e:
            self._fail(f"barrier {name!r}", timeout_s, e)

    def all_gather(self, name, data, timeout_s):
        self.client.key_value_set(self._key(f"{name}/{self.process_index}"), base64.b64encode(data).decode())
        out = []
        for i in range(self.process_count):
            try:
                v = self.client.blocking_key_value_get(self._key(f"{name}/{i}"), int(timeout_s * 1000))
            except Exception as e:
                self._fail(f"gather {name!r} from process {i}", timeout_s, e)
            out.append(base64.b64decode(v))
        return out

    def broadcast(self, name, data, timeout_s):
        if self.process_index == 0:
            self.client.key_value_set(self._key(name), base64.b64encode(data).decode())
            return data
        try:
            v = self.client.blocking_key_value_get(self._key(name), int(timeout_s * 1000))
        except Exception as e:
            self._fail(f"broadcast {name!r} from process 0", timeout_s, e)
        return base64.b64decode(v)


def current() -> Coordinator:
    """JaxDistributed when `jax.distributed.initialize` ran in this process, else SingleProcess."""
    from jax._src import distributed  # the public API exposes no accessor for the client

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return SingleProcess()
    return JaxDistributed(client, jax.process_index(), jax.process_count())
