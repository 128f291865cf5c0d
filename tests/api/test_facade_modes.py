"""A run on real workers refuses modes it cannot carry out yet, before starting anything."""

import pytest

from dynarl import ConfigError, DynaRL
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides


@pytest.mark.parametrize("mode", ["dynamic", "static-colocated", "rlhfuse"])
def test_modes_that_move_trainer_devices_are_refused_in_words(mode: str, tmp_path) -> None:
    cfg = apply_overrides(DynaRLConfig(), [f"scheduler.mode={mode}"])
    with pytest.raises(ConfigError, match="static-disaggregated") as info:
        DynaRL(cfg, run_dir=tmp_path / "run")
    assert info.value.field == "scheduler.mode"
    assert not (tmp_path / "run").exists()  # nothing was started or written
