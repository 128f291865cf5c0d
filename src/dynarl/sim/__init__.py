"""The cluster simulator's models: hardware, model shapes, costs, workloads, engines.

Everything here is pure and deterministic (randomness comes from a seeded numpy
``Generator`` passed in), so the simulator can later drive the real controller on a
virtual clock with these models standing in for devices.
"""

from dynarl.obs.trace_records import Request, TraceError
from dynarl.sim.costs import (
    ActorCost,
    DataParallelEfficiency,
    InferenceCost,
    MigrationCost,
    MigrationCostModel,
    WeightSyncCost,
)
from dynarl.sim.engine import SimEngine
from dynarl.sim.engine_config import EngineConfig
from dynarl.sim.errors import SimError
from dynarl.sim.hardware import A100, GPUS, H100, H200, GpuProfile, gpu
from dynarl.sim.jobs import EngineTotals, Job, JobDone, JobProgress
from dynarl.sim.models import MODELS, ModelProfile, model
from dynarl.sim.traces import Trace, read_trace, write_trace
from dynarl.sim.workloads import (
    AgenticWorkload,
    MathWorkload,
    ToolLatency,
)

__all__ = [
    "A100",
    "GPUS",
    "H100",
    "H200",
    "MODELS",
    "ActorCost",
    "AgenticWorkload",
    "DataParallelEfficiency",
    "EngineConfig",
    "EngineTotals",
    "GpuProfile",
    "InferenceCost",
    "Job",
    "JobDone",
    "JobProgress",
    "MathWorkload",
    "MigrationCost",
    "MigrationCostModel",
    "ModelProfile",
    "Request",
    "SimEngine",
    "SimError",
    "ToolLatency",
    "Trace",
    "TraceError",
    "WeightSyncCost",
    "gpu",
    "model",
    "read_trace",
    "write_trace",
]
