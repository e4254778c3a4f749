"""Fixtures the test files share (their helpers are plain functions in toys.py)."""

import pytest
import torch

from toys import make_tiny_world

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_world():
    """The untrained tiny TinyWorld of seed 0 (toys.make_tiny_world), one per test module."""
    return make_tiny_world(0)


@pytest.fixture(scope="module")
def tiny_weights(tiny_world, tmp_path_factory):
    """`tiny_world` and its weights file, for tests that load the model through the CLI or by path."""
    from calibrate.world.weights import save_weights

    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_weights(tiny_world, path)
    return tiny_world, path
