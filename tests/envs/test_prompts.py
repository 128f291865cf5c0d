"""Prompt files and the deterministic, resumable prompt order."""

import json
import sys
from pathlib import Path

import pytest

from dynarl.envs.config import DataConfig
from dynarl.envs.prompts import (
    Prompt,
    PromptError,
    PromptSampler,
    load_prompts,
    prompt_sampler,
    read_parquet,
)
from dynarl.envs.synthetic import SyntheticTask


def _write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    return path


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_id=str(i), text=f"q{i}") for i in range(n)]


def test_jsonl_records_keep_answer_and_metadata(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "2+2=", "answer": 4, "level": "easy"}, {"prompt": "hi", "id": "q7"}],
    )
    prompts = load_prompts(path)
    assert prompts == [
        Prompt(prompt_id="0", text="2+2=", answer="4", metadata={"level": "easy"}),
        Prompt(prompt_id="q7", text="hi"),
    ]


def test_bad_files_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n', encoding="utf-8")
    with pytest.raises(PromptError, match=r"bad.jsonl:2 is not valid JSON"):
        load_prompts(bad)
    no_prompt = _write_jsonl(tmp_path / "np.jsonl", [{"question": "x"}])
    with pytest.raises(PromptError, match="string field 'prompt'"):
        load_prompts(no_prompt)
    with pytest.raises(PromptError, match="JSON lines"):
        load_prompts(tmp_path / "prompts.csv")
    with pytest.raises(PromptError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(PromptError, match="no prompts"):
        load_prompts(empty)


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"], "k": [3, 4]}), path)
    assert load_prompts(path) == [
        Prompt(prompt_id="0", text="a", answer="1", metadata={"k": 3}),
        Prompt(prompt_id="1", text="b", answer="2", metadata={"k": 4}),
    ]


def test_parquet_without_pyarrow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PromptError, match="pip install pyarrow"):
        read_parquet(tmp_path / "p.parquet")


def test_each_epoch_is_a_seeded_permutation() -> None:
    sampler = PromptSampler(_prompts(10), shuffle=True, seed=3)
    epoch0 = [p.prompt_id for p in sampler.take(10)]
    epoch1 = [p.prompt_id for p in sampler.take(10)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(str(i) for i in range(10))
    assert epoch0 != epoch1
    assert sampler.epoch == 1
    again = PromptSampler(_prompts(10), shuffle=True, seed=3)
    assert [p.prompt_id for p in again.take(20)] == epoch0 + epoch1
    other_seed = PromptSampler(_prompts(10), shuffle=True, seed=4)
    assert [p.prompt_id for p in other_seed.take(10)] != epoch0
    in_order = PromptSampler(_prompts(3), shuffle=False)
    assert [p.prompt_id for p in in_order.take(5)] == ["0", "1", "2", "0", "1"]


def test_resuming_continues_the_same_order() -> None:
    uninterrupted = PromptSampler(_prompts(7), seed=11)
    expected = [p.prompt_id for p in uninterrupted.take(30)]
    first = PromptSampler(_prompts(7), seed=11)
    got = [p.prompt_id for p in first.take(12)]
    state = first.state_dict()
    resumed = PromptSampler(_prompts(7), seed=11)
    resumed.load_state_dict(state)
    got += [p.prompt_id for p in resumed.take(18)]
    assert got == expected
    with pytest.raises(PromptError, match="seed"):
        PromptSampler(_prompts(7), seed=12).load_state_dict(state)
    with pytest.raises(PromptError, match="does not fit"):
        PromptSampler(_prompts(3), seed=11).load_state_dict({"epoch": 0, "position": 5, "seed": 11})


def test_generator_source_is_read_by_index_and_resumes() -> None:
    def generate(index: int) -> Prompt:
        return Prompt(prompt_id=str(index), text="x" * (index % 4 + 1))

    sampler = PromptSampler(generate, seed=0)
    assert [p.prompt_id for p in sampler.take(3)] == ["0", "1", "2"]
    resumed = PromptSampler(generate, seed=0)
    resumed.load_state_dict(sampler.state_dict())
    assert [p.prompt_id for p in resumed.take(2)] == ["3", "4"]


def test_sampler_from_data_config(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
    unused = SyntheticTask(seed=0).prompt  # a file source ignores the generator
    from_file = prompt_sampler(
        DataConfig(source="file", path=str(path), shuffle=False), seed=0, generator=unused
    )
    assert [p.text for p in from_file.take(4)] == ["q0", "q1", "q2", "q3"]
    synthetic = prompt_sampler(DataConfig(), seed=5, generator=SyntheticTask(seed=5).prompt)
    first = synthetic.take(3)
    again = prompt_sampler(DataConfig(), seed=5, generator=SyntheticTask(seed=5).prompt)
    assert first == again.take(3)
    assert all(p.answer is not None for p in first)
