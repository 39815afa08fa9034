"""Test setup: 8 virtual CPU devices (DESIGN.md §8), set once before any device is used."""

import os

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def ckdir(tmp_path):
    """A fresh checkpoint directory path (not yet created)."""
    return str(tmp_path / "ckpt")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests need 8 CPU devices (tests/conftest.py sets jax_num_cpu_devices)"
    return devs


@pytest.fixture
def zarr_above_1mib(monkeypatch):
    """Leaves above 1 MiB become zarr arrays (by default only those above 4 MiB do): tests of the
    zarr path keep their arrays small. The layout code is the same for any threshold."""
    from ckpt_callbacks import snapshot
    monkeypatch.setattr(snapshot, "PACK_MAX_BYTES", 1 << 20)
