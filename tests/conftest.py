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
