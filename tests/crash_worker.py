"""A process that saves in a loop until killed (used by the crash-consistency tests).

    python tests/crash_worker.py DIR [--keep N] [--sync]

Each step's content is a pure function of the step (see `content`), so a checker can verify every
listed step bit for bit. Prints "ready" once the first save has started.
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt_callbacks as cc  # noqa: E402


def content(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((384, 1024)).astype(np.float32),      # 1.5 MiB: a zarr array
            "small": {f"s{i}": np.full(16, step * 100 + i, np.int32) for i in range(20)},
            "step": step}


def main():
    d = sys.argv[1]
    keep = int(sys.argv[sys.argv.index("--keep") + 1]) if "--keep" in sys.argv else 2
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    sh = NamedSharding(mesh, P("a", "b"))
    with cc.CheckpointManager(d, retention=cc.KeepLast(keep), async_save="--sync" not in sys.argv) as m:
        step = (m.latest_step() or 0) + 1
        first = True
        while True:
            tree = content(step)
            tree["w"] = jax.device_put(tree["w"], sh)
            m.save(step, tree)
            if first:
                print("ready", flush=True)
                first = False
            step += 1


if __name__ == "__main__":
    main()
