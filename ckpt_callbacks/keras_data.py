"""A resumable wrapper for index-based `keras.utils.PyDataset`s: mid-epoch resume without re-running batches.

Example::

    import keras
    from ckpt_callbacks.keras import AsyncCheckpoint
    from ckpt_callbacks.keras_data import ResumableDataset

    ds = ResumableDataset(MyPyDataset(...), shuffle_seed=0)      # any PyDataset with a length
    cb = AsyncCheckpoint("/tmp/run", save_freq=100, data=ds)
    model.fit(ds, epochs=10, shuffle=False, callbacks=[cb])      # re-run unchanged after a crash

Who calls what: the user wraps the dataset once and hands the same object to `fit` and to
`AsyncCheckpoint(data=...)`. On every process, `AsyncCheckpoint.on_epoch_begin` calls
`set_position(epoch, skip)` before Keras asks the dataset for its length, so the epoch Keras
runs is "the epoch's batch order, minus its first `skip` batches". `skip` is non-zero only for the
epoch a resumed run continues in the middle of; in every other epoch the wrapper is transparent
(apart from its own seeded shuffle). Without the callback the wrapper counts complete passes itself
(from 0 per wrapper object; not with ``use_multiprocessing=True``, whose fetches happen in other
processes), so a run with and one without checkpointing see the same batches.

Why a wrapper: Keras fixes the batches of an epoch when it builds the epoch's iterator and offers
no hook to start it at batch k. Its own ``fit(shuffle=True)`` draws a fresh order from Python's
global `random` for each epoch, which a resumed run cannot replay from the middle; so pass
``shuffle=False`` to `fit` and let the wrapper shuffle (``shuffle_seed``): its order for epoch e
is a pure function of ``(shuffle_seed, e)``. When Keras reaches the end of a shortened epoch it
warns that the input "ran out of data"; `AsyncCheckpoint` silences that one warning for that epoch.
"""

from __future__ import annotations

import keras
import numpy as np

from .errors import ConfigError

__all__ = ["ResumableDataset"]


class ResumableDataset(keras.utils.PyDataset):
    """A `PyDataset` view of `dataset` that can start an epoch at any batch. See the module docstring.

    Args:
      dataset: an index-based `keras.utils.PyDataset` with a finite `num_batches` (or `__len__`);
        its `workers`, `use_multiprocessing` and `max_queue_size` are taken over.
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
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset = dataset
        self.shuffle_seed = shuffle_seed
        self.epoch = 0
        self.skip = 0

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
        self.epoch, self.skip, self._fetched = int(epoch), int(skip), 0
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
        return self.dataset[int(order[self.skip + index])]

    def on_epoch_begin(self):
        self._fetched = 0
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        # Without the callback, the wrapper advances to the next epoch's order by itself after a
        # complete pass. Keras also begins/ends an "epoch" to peek at one batch before training
        # (and ends one at start-up), which must not count.
        if getattr(self, "_fetched", 0) >= self.num_batches:
            self.epoch, self.skip, self._order = self.epoch + 1, 0, None
        self._fetched = 0
        self.dataset.on_epoch_end()
