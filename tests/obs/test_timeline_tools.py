"""The tool component on the timeline: how many sessions are out on tool calls, as
the hypergraph sees them, drawn beside the devices."""

from pathlib import Path

from recipes import agentic_tiny

from dynarl.control import events as ev
from dynarl.control.pipeline import build_hypergraph
from dynarl.control.topology import PROMPTS
from dynarl.core.ids import GroupId, InstanceId, ItemId
from dynarl.obs.plot import plot_timeline
from dynarl.obs.timeline import TimelineRecorder, ToolLoad, read_timeline, write_timeline


def test_sessions_out_on_tool_calls_are_on_the_timeline(tmp_path: Path) -> None:
    graph, _ = build_hypergraph(agentic_tiny().pipeline_layout())
    recorder = TimelineRecorder(graph, run="dynamic", now_s=0.0)
    engine = InstanceId("rollout-0")
    refs = tuple(ev.ItemRef(ItemId(f"i{k}"), GroupId("g"), 10) for k in range(3))
    script: list[ev.Event] = [ev.ItemsEnqueued(edge=PROMPTS, items=refs, time_s=0.0)]
    for k, ref in enumerate(refs):
        script.append(ev.ItemRouted(edge=PROMPTS, item=ref.id, instance=engine, time_s=0.1))
        script.append(
            ev.ToolCallStarted(edge=PROMPTS, item=ref.id, instance=engine, time_s=1.0 + k)
        )
    script.append(ev.ToolCallFinished(edge=PROMPTS, item=refs[0].id, time_s=4.0))
    script.append(ev.ItemCompleted(edge=PROMPTS, item=refs[1].id, instance=engine, time_s=5.0))
    for event in script:
        graph.apply(event)
        recorder(event)
    loads = [(x.time_s, x.num_in_tool) for x in recorder.lines() if isinstance(x, ToolLoad)]
    assert loads == [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 2), (5.0, 1)]
    write_timeline(tmp_path / "timeline.jsonl", [recorder])
    lines = read_timeline(tmp_path / "timeline.jsonl")
    assert [x for x in lines if isinstance(x, ToolLoad)] == recorder.tool_loads
    plot_timeline(lines, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0
