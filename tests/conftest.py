"""Fixtures shared across test folders: a simulated two-node Ray cluster for the
launcher tests (tests/launch, the launcher contract), started once per session (each
Ray node costs seconds and ~0.6 GB)."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine (2 CPUs each, custom resources ``node-a`` and
    ``node-b``), this process connected to them."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # writes nothing to the home folder
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node-a": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2, resources={"node-b": 1})
        # The tests' worker mains live in the test packages: workers import them.
        tests = str(Path(__file__).resolve().parent)
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": tests}},
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before
