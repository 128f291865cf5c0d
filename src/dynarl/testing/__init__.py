"""Public fakes for tests: an in-process pipeline world and a harness that runs the
real controller against it on virtual time."""

from dynarl.testing.harness import HarnessResult, run_with_fake_world
from dynarl.testing.world import FakeWorld, FakeWorldConfig, MigrationError

__all__ = ["FakeWorld", "FakeWorldConfig", "HarnessResult", "MigrationError", "run_with_fake_world"]
