"""The command line names recipes and config files, and says what went wrong in words."""

import pytest

from dynarl.cli import main, resolve_config
from dynarl.core.errors import ConfigError


def test_a_recipe_that_needs_arguments_is_refused_with_the_ones_it_can_name() -> None:
    with pytest.raises(ConfigError, match="takes arguments; call it from Python") as info:
        resolve_config("paper_setting", [])
    assert "math_1_5b_64" in str(info.value) and "paper_setting;" not in str(info.value)


def test_an_unknown_recipe_is_an_error_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "no_such_recipe"]) == 2
    err = capsys.readouterr().err
    assert "no recipe 'no_such_recipe'" in err and "math_tiny" in err


def test_overrides_apply_to_a_named_recipe() -> None:
    cfg = resolve_config("math_tiny", ["scheduler.mode=static-colocated", "run.seed=7"])
    assert cfg.scheduler.mode == "static-colocated" and cfg.run.seed == 7


def test_profiling_gpus_is_refused_rather_than_measuring_the_cpu(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--set", "cluster.accelerator=cuda", "--out", str(out)]) == 2
    assert "set cluster.accelerator=cpu" in capsys.readouterr().err
    assert not out.exists()
