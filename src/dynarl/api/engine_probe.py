"""The decode probe as a run makes it (:mod:`dynarl.workers.decode_probe`): which
rollout engine sizes it measures as it starts, the engines it measures them on, and
the samples handed to the predictor.

A run in the dynamic mode with ``rollout.tail_tp`` scores regrouping its engines with
the predictor's decode costs at both sizes; where a profile did not give them, one
engine of each size is measured before the trainer loads, each alone on the machine.
"""

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from dynarl.api.config import DynaRLConfig
from dynarl.control.predictor import Predictor
from dynarl.control.topology import ROLLOUT
from dynarl.core.ids import InstanceId
from dynarl.workers.protocol import DecodeSample

if TYPE_CHECKING:
    from dynarl.api.world import RealWorld

logger = logging.getLogger(__name__)


def engine_sizes_to_probe(cfg: DynaRLConfig, predictor: Predictor) -> tuple[int, ...]:
    """The rollout engine sizes (devices) a run measures as it starts: both,
    ``rollout.tp`` and ``rollout.tail_tp``, in the dynamic mode with a tail size, unless
    the predictor has decode costs for both already (a profile that measured them:
    ``scheduler.predictor_profile``, or a resumed run's ``predictor.json``). Both, so
    that the regroup compares engines measured alike."""
    tail = cfg.rollout.tail_tp if cfg.scheduler.mode == "dynamic" else 0
    sizes = (cfg.rollout.tp, tail)
    if not tail or all(predictor.step_costs(ROLLOUT, size) is not None for size in sizes):
        return ()
    return sizes


async def probe_engines(world: "RealWorld", sizes: Sequence[int]) -> list[DecodeSample]:
    """Measure a rollout engine of each of ``sizes`` devices, one at a time (alone on
    the machine), on the first aligned group of that size: its slot takes the role
    (resumed where prebuilt), is probed and releases it again."""
    samples: list[DecodeSample] = []
    for size in sizes:
        group = next(
            (g for d in world.slot_devices if (g := world.led_group(d, size)) is not None), None
        )
        if group is None:
            logger.warning("no %d slots in an aligned group: no engine of %d probed", size, size)
            continue
        slot = world.slot(group[0])
        await slot.build_role(world.rollout_role(group), instance=InstanceId(slot.name))
        measured = await slot.measure_decode()
        await slot.release_memory(host_backup=True)
        logger.info(
            "probed a rollout engine of %d devices: %s",
            size,
            ", ".join(
                f"{s.load} x {s.context:.0f} tokens: {s.throughput:.0f} tok/s" for s in measured
            ),
        )
        samples.extend(measured)
    return samples


def observe_samples(predictor: Predictor, samples: Iterable[DecodeSample]) -> None:
    """Fold the probe's samples into the rollout's fit of each engine's size."""
    for s in samples:
        predictor.observe(
            ROLLOUT,
            s.engine_devices,
            s.load,
            s.throughput,
            context=s.context,
            unit=s.engine_devices,
        )
