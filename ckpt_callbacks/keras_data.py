"""A resumable wrapper for index-based `keras.utils.PyDataset`s: mid-epoch resume without re-running batches.

Example::

    import keras, numpy as np
    from ckpt_callbacks.keras import AsyncCheckpoint
    from ckpt_callbacks.keras_data import ResumableDataset

    class Batches(keras.utils.PyDataset):                       # any PyDataset with a length
        def __len__(self):
            return 50
        def __getitem__(self, i):
            return np.full((8, 4), i / 50, np.float32), np.full((8, 1), i / 50, np.float32)

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    ds = ResumableDataset(Batches(), shuffle_seed=0)
    cb = AsyncCheckpoint("/tmp/run", save_freq=100, data=ds)
    model.fit(ds, epochs=10, shuffle=False, callbacks=[cb])      # re-run unchanged after a crash

Who calls what: the user wraps the dataset once and hands the same object to `fit` and to
`AsyncCheckpoint(data=...)`. On every process, `AsyncCheckpoint.on_epoch_begin` calls
`set_position(epoch, skip)` before Keras asks the dataset for its length, so the epoch Keras
runs is "the epoch's batch order, minus its first `skip` batches". `skip` is non-zero only for the
epoch a resumed run continues in the middle of; in every other epoch the wrapper is transparent
(apart from its own seeded shuffle). Without the callback the wrapper counts complete passes itself
(from 0 per wrapper object), so a run with and one without checkpointing see the same batches.

Worker threads: Keras' own prefetching (`workers` > 1) carries batches it fetched ahead over epoch
boundaries (it stops its queue at each epoch's end and serves what was left at the start of the
next epoch), so no batch position could be resumed. The wrapper therefore tells Keras
``workers=1`` and runs the dataset's `workers` threads itself, fetching up to `max_queue_size`
batches ahead within the epoch's order only, while Keras asks for them in order (``fit(shuffle=
False)``); the threads are stopped, their fetches finished or cancelled, before the dataset's own
`on_epoch_begin`/`on_epoch_end` run. ``use_multiprocessing=True`` is refused (worker processes
would never see `set_position`).

Why a wrapper: Keras fixes the batches of an epoch when it builds the epoch's iterator and offers
no hook to start it at batch k. Its own ``fit(shuffle=True)`` draws a fresh order from Python's
global `random` for each epoch, which a resumed run cannot replay from the middle; so pass
``shuffle=False`` to `fit` and let the wrapper shuffle (``shuffle_seed``): its order for epoch e
is a pure function of ``(shuffle_seed, e)``. When Keras reaches the end of a shortened epoch it
warns that the input "ran out of data"; `AsyncCheckpoint` silences that one warning for that epoch.
"""

from __future__ import annotations

import concurrent.futures
import logging
import weakref

import keras
import numpy as np

from .errors import ConfigError

__all__ = ["ResumableDataset"]

log = logging.getLogger("ckpt_callbacks")


class ResumableDataset(keras.utils.PyDataset):
    """A `PyDataset` view of `dataset` that can start an epoch at any batch.

    Example::

        import keras, numpy as np
        from ckpt_callbacks.keras_data import ResumableDataset
        class Squares(keras.utils.PyDataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return np.full((2, 1), i, np.float32), np.full((2, 1), i * i, np.float32)
        ds = ResumableDataset(Squares(), shuffle_seed=0)
        ds.set_position(epoch=1, skip=3)   # what AsyncCheckpoint does when a run resumed after batch 3
        len(ds), ds[0]                     # 1 batch left: the last of epoch 1's shuffled order

    Who calls what, and Keras' worker threads: see the module docstring.

    Args:
      dataset: an index-based `keras.utils.PyDataset` with a finite `num_batches` (or `__len__`);
        its `workers` (threads) and `max_queue_size` are taken over: the wrapper fetches that
        many batches ahead on that many threads, within the current epoch's order.
      shuffle_seed: None keeps the dataset's order; an int shuffles the batch order of each epoch
        by ``numpy.random.default_rng((shuffle_seed, epoch))``.
    """

    def __init__(self, dataset, *, shuffle_seed: int | None = None):
        if not isinstance(dataset, keras.utils.PyDataset):
            raise ConfigError(f"ResumableDataset wraps a keras.utils.PyDataset, got {type(dataset).__name__}; "
                              "for arrays, put them in a PyDataset whose __getitem__ returns batch i")
        n = dataset.num_batches
        if n is None:
            raise ConfigError("ResumableDataset needs a finite dataset (num_batches is None): an infinite "
                              "PyDataset has no epoch position to resume at")
        if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)):
            raise ConfigError(f"shuffle_seed must be None or an int, got {shuffle_seed!r}")
        if dataset.use_multiprocessing:
            raise ConfigError("ResumableDataset cannot resume batches fetched by worker processes "
                              "(use_multiprocessing=True: they never see the position to resume at). Fix: "
                              "use_multiprocessing=False; the wrapper fetches on `workers` threads itself")
        super().__init__(workers=1, use_multiprocessing=False, max_queue_size=dataset.max_queue_size)
        self.dataset = dataset
        self.shuffle_seed = shuffle_seed
        self.epoch = 0
        self.skip = 0
        self._threads = max(1, int(dataset.workers or 1))
        self._ahead = max(1, int(dataset.max_queue_size or 1))
        self._pool = None
        self._pending: dict = {}    # index -> future of that batch, for the order of `_pending_for`
        self._pending_for = None
        self._next = 0              # the index Keras asks for next when it reads in order
        self._warned_order = False
        self.served = 0             # batches read from it in all (AsyncCheckpoint: is it fit()'s input?)

    def batch_order(self, epoch: int) -> np.ndarray:
        """The indices into `dataset` that epoch `epoch` visits, in order (before skipping)."""
        n = int(self.dataset.num_batches)
        if self.shuffle_seed is None:
            return np.arange(n)
        return np.random.default_rng((self.shuffle_seed, epoch)).permutation(n)

    def set_position(self, epoch: int, skip: int = 0) -> None:
        """Make the next epoch Keras runs be `epoch`, starting after its first `skip` batches.

        Called by `AsyncCheckpoint.on_epoch_begin`; call it yourself only without the callback.
        """
        n = int(self.dataset.num_batches)
        if not 0 <= skip <= n:
            raise ConfigError(f"cannot skip {skip} batches of an epoch of {n} batches: the dataset changed "
                              "length since the checkpoint was saved")
        self.epoch, self.skip, self._fetched, self._next = int(epoch), int(skip), 0, 0
        self._order = self.batch_order(self.epoch)

    @property
    def num_batches(self):
        return int(self.dataset.num_batches) - self.skip

    def __len__(self):
        return self.num_batches

    def __getitem__(self, index):
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range for an epoch of {self.num_batches} batches")
        order = getattr(self, "_order", None)
        if order is None:
            order = self._order = self.batch_order(self.epoch)
        self._fetched = getattr(self, "_fetched", 0) + 1
        self.served += 1
        in_order = index in (0, self._next)
        self._next = index + 1
        if not in_order and not self._warned_order:
            self._warned_order = True
            log.warning("ckpt_callbacks: ResumableDataset: Keras asks for batches out of order (fit(shuffle=True)?), "
                        "so a resumed epoch would not continue exactly (and nothing is fetched ahead); pass "
                        "shuffle=False to fit() and shuffle_seed= to the wrapper")
        if self._threads == 1:
            return self.dataset[int(order[self.skip + index])]
        return self._prefetched(order, index, in_order)

    def _prefetched(self, order, index: int, in_order: bool):
        """Batch `index` of the current epoch, and the next `max_queue_size` ones submitted to the
        worker threads. Keras asks for indices in order on its main thread (and starts again at 0
        after peeking at the first batch); fetches for another position or epoch are dropped."""
        at = (self.epoch, self.skip, id(order))
        if at != self._pending_for:
            self._stop()
            self._pending_for = at
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="ResumableDataset")
            # a wrapper dropped mid-epoch (fit() raised) does not keep its threads waiting
            self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        for j in [j for j in self._pending if j < index]:   # behind us: never asked for again
            self._pending.pop(j).cancel()
        def fetch(j):
            return self._pool.submit(self.dataset.__getitem__, int(order[self.skip + j]))

        future = self._pending.pop(index, None) or fetch(index)
        ahead = range(index + 1, min(index + 1 + self._ahead, self.num_batches)) if in_order else ()
        for j in ahead:
            if j not in self._pending:
                self._pending[j] = fetch(j)
        return future.result()

    def _stop(self) -> None:
        """Cancel the fetches not started, and wait for those running (the dataset's own epoch
        hooks must not run alongside them)."""
        for f in self._pending.values():
            f.cancel()
        self._pending, self._pending_for = {}, None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            self._finalizer.detach()
            pool.shutdown(wait=True, cancel_futures=True)

    def on_epoch_begin(self):
        self._stop()
        self._fetched, self._next = 0, 0
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        # Without the callback, the wrapper advances to the next epoch's order by itself after a
        # complete pass. Keras also begins/ends an "epoch" to peek at one batch before training
        # (and ends one at start-up), which must not count.
        self._stop()
        if getattr(self, "_fetched", 0) >= self.num_batches:
            self.epoch, self.skip, self._order = self.epoch + 1, 0, None
        self._fetched, self._next = 0, 0
        self.dataset.on_epoch_end()
