"""The cost models of a simulated run: the GPU models of
:class:`~dynarl.sim.cluster.ClusterModel` for a built-in GPU, or those of a measured CPU
profile (:func:`~dynarl.sim.cpu_profile.cpu_cluster`) when ``sim.gpu`` names one (a
built-in CPU profile, or a profile file).
"""

from dynarl.sim.cluster import ClusterModel, trace_workload
from dynarl.sim.config import SimulatedRun
from dynarl.sim.cpu_profile import cpu_cluster, cpu_profile


def build_cluster(run: SimulatedRun) -> ClusterModel:
    """Every cost model and the workload of ``run``, on the device ``sim.gpu`` names."""
    if cpu_profile(run.sim.gpu) is not None:
        return cpu_cluster(run, workload=None if run.sim.trace is None else trace_workload(run))
    return ClusterModel.for_gpu(run)
