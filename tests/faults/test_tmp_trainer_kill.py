import time
from pathlib import Path
import pytest
pytest.importorskip("torch")
from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.api.facade import DynaRL
from dynarl.testing.faults import FaultInjector, WorkerKill

@pytest.mark.timeout(900)
async def test_trainer_kill(tmp_path: Path) -> None:
    cfg = apply_overrides(DynaRLConfig(), ["run.checkpoint_every=0", f"run.run_dir={tmp_path}", "run.num_iterations=3"])
    kill = WorkerKill(target="trainer", point="optimizer_step", iteration=1)
    async with DynaRL(cfg) as rl:
        injector = FaultInjector(rl, [kill])
        injector.attach()
        await rl.run()
    print("KILLS", injector.kills)
    print("REWARDS", [s.mean_reward for s in rl.history])
    for (iteration, edge), counts in injector.completions().items():
        print(iteration, edge, len(counts), set(counts.values()))
