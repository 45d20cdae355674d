"""Fixtures of the mixkv pytest suite (helpers.py has the helpers)."""

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
