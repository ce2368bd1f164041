import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    harness.close_all()
