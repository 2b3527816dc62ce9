from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py and tests/data for the test folders below


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each test that takes it runs on the CPU and, where present, on CUDA."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return torch.device(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fuzzer's file (tests/hostile/test_fuzz.py: 60 s, printing nothing while it runs) goes
    last, so that a plain ``pytest`` starts with tests that report as they go. Nothing else moves."""
    last = [item for item in items if item.path.name == "test_fuzz.py" and item.path.parent.name == "hostile"]
    if last:
        moved = set(map(id, last))
        items[:] = [item for item in items if id(item) not in moved] + last
