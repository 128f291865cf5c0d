"""Hold the trainer at a step boundary when devices are about to join it.

An optimizer step runs to its end on the devices it started on. Started on a few
devices while the other stages finish their last work, it keeps the devices they free
waiting at its boundary (in a simulated 32B iteration, 32 devices for 270 s). When the
predictor says the step ends sooner if it waits for those devices (their stages'
predicted finish plus a reshard, then the step on all of them), the trainer is held:
its workers do not start the next step until the hold is lifted. The hold is
re-decided after every scheduling decision, also while moves are under way (their
devices count where they go), and lifts by itself once nothing is left upstream (then
no device is on its way).
"""

from dynarl.control.estimates import Estimates, or_fresh
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.predictor import Predictor
from dynarl.control.trainer_steps import trainers_to_hold
from dynarl.core.ids import ComponentId


class HoldForDevices:
    """Hold trainers whose next step would finish sooner on devices still to come."""

    def __init__(self, predictor: Predictor, estimates: Estimates | None = None) -> None:
        self.predictor = predictor
        self.estimates = or_fresh(estimates)

    def holds(self, graph: Hypergraph) -> frozenset[ComponentId]:
        """Trainers to hold: those the predictor's schedule has wait for devices."""
        return frozenset(trainers_to_hold(graph, self.predictor, self.estimates))
