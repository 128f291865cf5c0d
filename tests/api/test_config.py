"""Configuration: files, overrides, and errors that name the field and the fix."""

import json

import msgspec
import pytest

from dynarl import ConfigError
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides, convert, dump_config, load_config
from dynarl.control.config import SchedulerConfig
from dynarl.control.pipeline import build_pipeline


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_a_config_survives_a_round_trip_through_each_format(tmp_path, suffix: str) -> None:
    cfg = apply_overrides(
        DynaRLConfig(),
        ["scheduler.u_low=0.3", "rollout.tp=2", "rollout.initial_devices=2", "model.path=/m"],
    )
    path = tmp_path / f"run{suffix}"
    dump_config(cfg, path)
    assert load_config(path) == cfg


def test_overrides_parse_values_by_type() -> None:
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            "scheduler.mode=static-colocated",
            "scheduler.rollout_borrows_actor=false",
            "run.num_iterations=3",
            "actor.lr=3e-4",
            "data.path=prompts.jsonl",
        ],
    )
    assert cfg.scheduler.mode == "static-colocated"
    assert cfg.scheduler.rollout_borrows_actor is False
    assert (cfg.run.num_iterations, cfg.actor.lr, cfg.data.path) == (3, 3e-4, "prompts.jsonl")


@pytest.mark.parametrize(
    ("override", "field", "says"),
    [
        ("scheduler.u_low=1.5", "scheduler.u_low", ["1.5", "< 1.0"]),
        ("scheduler.mode=fast", "scheduler.mode", ["'fast'", "'dynamic'", "'static-colocated'"]),
        ("rollout.tp=two", "rollout.tp", ["'two'", "an int >= 1"]),
        ("rollout.tail_tp=3 rollout.tp=2", "rollout.tail_tp", ["multiple of rollout.tp=2", "=4"]),
        ("rollout.tail_tp=1", "rollout.tail_tp", ["larger than it", "or 0"]),
        ("rollout.tpp=2", "rollout.tpp", ["known fields", "tp"]),
        ("bogus.x=1", "bogus.x", ["no field 'bogus'", "scheduler"]),
        ("scheduler.num_candidates=20", "scheduler.num_candidates", ["<= 10"]),
        ("cluster.num_devices=2", "cluster.num_devices", ["4 devices", "initial_devices"]),
        ("algorithm.n_minibatches=3", "algorithm.n_minibatches", ["64 samples"]),
        ("model.hidden_size=65", "model.hidden_size", ["multiple of model.num_heads"]),
        ("data.source=file", "data.path", ["needs data.path"]),
        ("algorithm.kl_coef=0.1", "algorithm.kl_coef", ["inference.compute_ref_logprobs=true"]),
        ("model.tokenizer=chat model.path=/m", "model.tokenizer", ["model.tokenizer=null"]),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(
    override: str, field: str, says: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(DynaRLConfig(), override.split())
    assert info.value.field == field
    for text in says:
        assert text in str(info.value)


def test_a_checkpoint_path_over_a_recipe_with_a_built_in_tokenizer_drops_it() -> None:
    chat = apply_overrides(DynaRLConfig(), ["model.tokenizer=chat"])
    cfg = apply_overrides(chat, ["model.tokenizer=null", "model.path=/m"])
    assert (cfg.model.path, cfg.model.tokenizer) == ("/m", None)


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        (
            ["algorithm.old_logprobs=rollout"],
            "inference.initial_devices",
            ["idle", "inference.initial_devices=0"],
        ),
        (
            [
                "algorithm.old_logprobs=rollout",
                "inference.initial_devices=0",
                "inference.compute_ref_logprobs=true",
            ],
            "algorithm.old_logprobs",
            ["algorithm.old_logprobs=inference"],
        ),
        (
            ["scheduler.mode=static-disaggregated", "inference.initial_devices=0"],
            "algorithm.old_logprobs",
            ["give inference devices", "algorithm.old_logprobs=rollout"],
        ),
    ],
)
def test_old_logprobs_and_the_inference_devices_must_agree(
    overrides: list[str], field: str, says: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(DynaRLConfig(), overrides)
    assert info.value.field == field
    for text in says:
        assert text in str(info.value)


def test_the_engines_own_logprobs_leave_no_inference_stage() -> None:
    from dynarl.control.pipeline import build_hypergraph
    from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT, TO_ACTOR

    recomputed = apply_overrides(DynaRLConfig(), [])
    own = apply_overrides(
        DynaRLConfig(), ["algorithm.old_logprobs=rollout", "inference.initial_devices=0"]
    )
    assert (recomputed.inference_forwards, own.inference_forwards) == (1, 0)
    graph, baseline = build_hypergraph(recomputed.pipeline_layout())
    assert INFERENCE in graph.components and graph.stage_order == (ROLLOUT, INFERENCE, ACTOR)
    graph, baseline = build_hypergraph(own.pipeline_layout())
    assert INFERENCE not in graph.components and INFERENCE not in baseline
    assert graph.stage_order == (ROLLOUT, ACTOR)
    assert [e.producer for e in graph.spec.edges if e.id == TO_ACTOR] == [ROLLOUT]


def test_unknown_keys_in_files_are_errors_not_ignored(tmp_path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"rollout": {"tp": 1, "temprature": 0.7}}))
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.temprature'") as info:
        load_config(path)
    assert "temperature" in str(info.value)


def test_unreadable_or_malformed_files_say_what_is_wrong(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"\.yaml, \.yml, \.toml or \.json"):
        load_config(tmp_path / "cfg.ini")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rollout = [")
    with pytest.raises(ConfigError, match="not valid toml"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(listy)


def test_sections_are_frozen_and_keyword_only() -> None:
    cfg = DynaRLConfig()
    with pytest.raises(AttributeError):
        cfg.scheduler.u_low = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SchedulerConfig("dynamic")  # type: ignore[misc]
    assert convert(msgspec.to_builtins(cfg)) == cfg


def test_pipeline_places_the_actor_first_then_rollout_then_inference() -> None:
    cfg = apply_overrides(
        DynaRLConfig(),
        [
            "cluster.num_devices=8",
            "rollout.tp=2",
            "rollout.initial_devices=4",
            "actor.initial_devices=2",
            "inference.initial_devices=2",
        ],
    )
    spec, placement, baseline = build_pipeline(cfg.pipeline_layout())
    assert [i.devices for i in placement["actor"]] == [(0,), (1,)]
    assert [i.devices for i in placement["rollout"]] == [(2, 3), (4, 5)]
    assert [i.devices for i in placement["inference"]] == [(6,), (7,)]
    assert baseline == {"actor": 2, "rollout": 4, "inference": 2}
    assert spec.component("actor").valid_sizes == (1, 2, 4, 8)  # divide the 32-sample minibatch


def test_completion_ordered_minibatches_need_whole_groups_per_minibatch() -> None:
    with pytest.raises(ConfigError, match="multiple of n_minibatches") as info:
        apply_overrides(
            DynaRLConfig(),
            [
                "algorithm.num_prompts=6",
                "algorithm.n_minibatches=4",
                "algorithm.minibatch_order=completion",
            ],
        )
    assert info.value.field == "algorithm.minibatch_order"


@pytest.mark.parametrize(
    ("suffix", "text", "says"),
    [
        (
            ".yaml",
            "scheduler:\n  mode: dynamic\nrun:\n  seed: 1\nscheduler:\n  u_low: 0.3\n",
            ["'scheduler'", "lines 1 and 5"],
        ),
        (".yaml", "run:\n  seed: 1\n  seed: 2\n", ["'seed'", "lines 2 and 3"]),
        (".json", '{"run": {"seed": 1}, "run": {"seed": 2}}', ["'run'"]),
        (".toml", "[run]\nseed = 1\n[run]\nseed = 2\n", ["('run',)", "twice"]),
    ],
)
def test_a_file_that_repeats_a_section_is_an_error_naming_the_key(
    tmp_path, suffix: str, text: str, says: list[str]
) -> None:
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert all(s in str(caught.value) for s in [str(path), *says]), str(caught.value)


def test_every_bad_field_of_a_file_is_reported_in_one_error(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        "scheduler:\n  mode: fast\n  u_low: 2\nrun:\n  num_iterations: three\nrollout:\n  tpp: 1\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith("4 config errors:")
    for field in ("scheduler.mode", "scheduler.u_low", "run.num_iterations", "'rollout.tpp'"):
        assert field in message, message
    assert caught.value.field == "scheduler.mode"


def test_one_bad_field_keeps_its_plain_message_and_rules_between_fields_still_hold() -> None:
    with pytest.raises(ConfigError, match=r"^invalid config value for scheduler.u_low"):
        apply_overrides(DynaRLConfig(), ["scheduler.u_low=2"])
    with pytest.raises(ConfigError, match="64 samples"):
        apply_overrides(DynaRLConfig(), ["algorithm.n_minibatches=3", "run.seed=1"])


def test_buddy_copies_can_be_turned_off_only_where_the_distributed_optimizer_runs() -> None:
    on_cuda = ["actor.backend=megatron", "cluster.accelerator=cuda", "cluster.num_devices=4"]
    off = "actor.megatron.buddy_copies=false"
    cfg = apply_overrides(DynaRLConfig(), [*on_cuda, off])  # the optimizer is on there
    assert not cfg.actor.megatron.buddy_copies
    sliced = ["actor.backend=megatron", "actor.megatron.distributed_optimizer=true"]
    assert not apply_overrides(DynaRLConfig(), [*sliced, off]).actor.megatron.buddy_copies
    for refused in (
        ["actor.backend=megatron", off],  # CPU: torch's AdamW unless asked
        ["actor.backend=megatron", "actor.megatron.distributed_optimizer=false", off],
    ):
        with pytest.raises(ConfigError) as info:
            apply_overrides(DynaRLConfig(), refused)
        assert info.value.field == "actor.megatron.buddy_copies", info.value
        assert "drop actor.megatron.buddy_copies" in str(info.value)
