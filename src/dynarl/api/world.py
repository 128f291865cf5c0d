"""The real world of a run: worker processes for the devices, and the handles that
reach them.

Device slots (one process each, from the :class:`~dynarl.launch.local.LocalLauncher`)
serve rollout and inference instances with the backends their sections name; trainer
workers (the :class:`~dynarl.workers.trainer.Trainer` ``actor.backend`` names, one
worker per device) are the actor's data-parallel ranks. A device that only ever runs
the actor gets no slot, and one that never runs the actor gets no trainer worker: under
``static-disaggregated`` each device has one process; otherwise every device has both,
and one of them holds the device at a time (the other's memory is released, or the
trainer is parked).

The world also owns the weight-sync group (:class:`~dynarl.api.engine_weights.EngineWeights`):
the trainer's rank 0 and every slot that serves a role now; a slot that takes a role
mid-run gets the weights the engines run before anything is routed to it.

Backends are imported by :meth:`RealWorld.start` (through the backend table) and in
the workers' processes.
"""

import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import anyio

from dynarl.api.config import DynaRLConfig
from dynarl.api.engine_probe import probe_engines
from dynarl.api.engine_weights import EngineWeights
from dynarl.api.reboots import Reboots
from dynarl.control.hypergraph import Hypergraph
from dynarl.control.topology import ACTOR, INFERENCE, ROLLOUT
from dynarl.core.ids import ComponentId, DeviceId, InstanceId
from dynarl.data.router import Router
from dynarl.launch.launcher import Launcher
from dynarl.launch.launchers import build_launcher
from dynarl.workers import backends
from dynarl.workers.handles import CallChannel, SlotHandle
from dynarl.workers.protocol import DecodeSample, InferenceRole, RolloutRole
from dynarl.workers.slot import SlotConfig
from dynarl.workers.trainer import Trainer

logger = logging.getLogger(__name__)


class RealWorld:
    """Where a run's workers live, and their handles by instance.

    Args:
        cfg: the run's configuration.
        graph: the controller's hypergraph in its initial placement (read only).
        router: the data router the slots connect to (bound and running).
        log_dir: where the output of workers on other nodes is copied (Ray launcher).
    """

    def __init__(
        self, cfg: DynaRLConfig, graph: Hypergraph, router: Router, *, log_dir: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.graph = graph
        self.router = router
        elastic = cfg.scheduler.mode != "static-disaggregated"
        actor_devices = {d for n in graph.components[ACTOR].instances.values() for d in n.devices}
        all_devices = [DeviceId(d) for d in range(cfg.cluster.num_devices)]
        self.slot_devices: list[DeviceId] = [
            d for d in all_devices if elastic or d not in actor_devices
        ]
        """Devices with a slot process, in slot order."""
        self.trainer_devices: list[DeviceId] = [
            d for d in all_devices if elastic or d in actor_devices
        ]
        """Devices with a trainer worker, in worker order."""
        self.trainer_names = [f"trainer-{i}" for i in range(len(self.trainer_devices))]
        """The trainer workers' names, in worker order."""
        self._trainer_device = dict(zip(self.trainer_names, self.trainer_devices, strict=True))
        self.launcher: Launcher = build_launcher(
            cfg.cluster,
            router,
            num_slots=len(self.slot_devices),
            slot=SlotConfig(
                num_threads=cfg.cluster.threads_per_device,
                preload_modules=backends.preload_modules(cfg.rollout, cfg.inference),
                import_warnings=backends.import_warnings(cfg.rollout, cfg.inference),
            ),
            slot_devices=self.slot_devices,
            worker_devices=self._trainer_device,
            # A model-parallel group of any component stays on one node.
            group_size=math.lcm(cfg.rollout.tp, cfg.inference.tp, cfg.actor.tp),
            log_dir=log_dir,
        )
        self.trainer: Trainer | None = None
        """The actor (after :meth:`start`)."""
        self.trainer_workers: list[SlotHandle] = []
        """The trainer's worker processes (after :meth:`start`), in worker order."""
        self.decode_samples: list[DecodeSample] = []
        """What :meth:`start` measured of the rollout engines it was asked to probe."""
        self._serving: dict[InstanceId, SlotHandle] = {}
        self.lost: set[str] = set()
        """Names of slots whose worker died."""
        self.weights = EngineWeights(
            serving=lambda: self.serving_slots, sender_host=self._sender_host, lost=self.lost
        )
        """The weight-sync group and the version the engines run."""
        self.reboots = Reboots(self)
        """Starts dead slots and trainer workers again (the reboot of a crashed device)."""
        self.on_failure: Callable[[BaseException], None] | None = None
        self.switch_listeners: list[Callable[[ComponentId, list[SlotHandle]], None]] = []
        self.resize_listeners: list[Callable[[tuple[int, ...]], None]] = []
        """Called as a resize of the trainer starts, with its new members (a fault
        injector kills a worker there)."""
        """Called as slots start to assume a role (a fault injector kills one there)."""
        """Called when the world cannot go on (a trainer rank died): the run stops."""
        self.failure: BaseException | None = None
        """Why the world cannot go on, once it cannot."""

    def rollout_role(self, devices: Sequence[DeviceId]) -> RolloutRole:
        """The role the slot of ``devices[0]`` assumes to serve rollout as an engine on
        ``devices`` (its tensor-parallel group). An engine of the tail's size is a server
        of its own, numbered past the slots' (the slot keeps one of each size)."""
        index = self.slot_devices.index(devices[0])
        if len(devices) != self.cfg.rollout.tp:
            index += len(self.slot_devices)
        return RolloutRole(
            model=self.cfg.model,
            rollout=self.cfg.rollout,
            order=self.cfg.rollout.request_order,
            seed=self.cfg.run.seed,
            accelerator=self.cfg.cluster.accelerator,
            device=devices[0],
            devices=tuple(int(d) for d in devices),
            server_index=index,
        )

    def inference_role(self, device: DeviceId) -> InferenceRole:
        """The role ``device``'s slot assumes to serve inference."""
        return InferenceRole(
            model=self.cfg.model,
            inference=self.cfg.inference,
            seed=self.cfg.run.seed,
            accelerator=self.cfg.cluster.accelerator,
            device=device,
        )

    def slot(self, device: DeviceId) -> SlotHandle:
        """The slot process of ``device``."""
        return self.launcher.handles[self.slot_devices.index(device)]

    def replica_of(self, worker: InstanceId) -> InstanceId | None:
        """The actor replica (an instance of the model) whose devices hold trainer
        worker ``worker`` now, if any."""
        device = self._trainer_device.get(worker)
        if device is None:
            return None
        holder = self.graph.device_owner.get(device)
        if holder is None or holder not in self.graph.instances:
            return None  # free, or in transit
        node = self.graph.instances[InstanceId(holder)]
        return node.id if node.component == ACTOR else None

    def host_of(self, worker: str) -> str:
        """The address other nodes reach ``worker``'s node at (where it hosts a
        torch.distributed rendezvous)."""
        return self.launcher.locations[worker].host

    def _sender_host(self, trainer: Trainer) -> str:
        """Where the weight-sync group's store is: the node of the trainer's rank 0
        (its sender). A parked trainer names no ranks: its workers' node then, which
        is right while they share one node (warned otherwise)."""
        ranks = trainer.rank_instances()
        if ranks:
            return self.host_of(ranks[0])
        hosts = {self.host_of(name) for name in self.trainer_names}
        if len(hosts) > 1:
            logger.warning(
                "the parked trainer's workers span nodes %s: the weight-sync group "
                "rendezvous at %s (trainer-0's node) may not be its sender's",
                sorted(hosts),
                self.host_of(self.trainer_names[0]),
            )
        return self.host_of(self.trainer_names[0])

    def trainer_members(self, devices: Sequence[DeviceId]) -> list[int]:
        """The trainer workers of ``devices``."""
        return [self.trainer_devices.index(d) for d in devices]

    @property
    def serving_slots(self) -> list[SlotHandle]:
        """Slots that serve a role now, in slot order (the weight-sync group's engines)."""
        serving = set(map(id, self._serving.values()))
        return [h for h in self.launcher.handles if id(h) in serving]

    # ------------------------------------------------------------------ start, stop

    async def start(self, *, probe_sizes: Sequence[int] = ()) -> None:
        """Start the slots and the trainer, give every initial instance its role,
        start training and build the weight-sync group (version 0 is synced). Before
        the trainer loads, one rollout engine of each size (devices) in ``probe_sizes``
        is measured (:attr:`decode_samples`; :mod:`dynarl.workers.decode_probe`).

        On failure, what started is left for :meth:`aclose`.
        """
        from dynarl.rl.grpo import GrpoLoss

        cfg = self.cfg
        threads = cfg.cluster.threads_per_device
        backend = backends.trainer_backend(cfg.actor)
        names = self.trainer_names

        async def start_trainer_workers() -> None:
            self.trainer_workers = await self.launcher.start_workers(
                backend.trainer_worker_entry, names, num_threads=threads
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(self.launcher.start)
            tg.start_soon(start_trainer_workers)
        trainer = backend.build_trainer(
            model=cfg.model,
            actor=cfg.actor,
            loss=GrpoLoss.from_config(cfg.algorithm),
            seed=cfg.run.seed,
            workers=[CallChannel(self.router, name) for name in names],
            num_threads=threads,
            rendezvous_host=self.host_of(names[0]),
            accelerator=cfg.cluster.accelerator,
            devices=self.trainer_devices,
        )
        self.trainer = self.weights.trainer = trainer
        await self._prebuild_roles()
        self.decode_samples = await probe_engines(self, probe_sizes)
        actor = sorted(self.graph.components[ACTOR].active_instances(), key=lambda n: n.id)
        await trainer.start(tuple(self.trainer_members([d for n in actor for d in n.devices])))
        self._route_to_ranks()
        async with anyio.create_task_group() as tg:
            for component in (ROLLOUT, INFERENCE):
                if component not in self.graph.components:
                    continue  # no inference stage: the engines' own log-probs
                nodes = self.graph.components[component].active_instances()
                instances = [(n.devices, n.id) for n in nodes]
                if instances:
                    tg.start_soon(functools.partial(self.assume, component, instances, hold=False))
        await self.weights.sync_weights(0)
        logger.info(
            "world started: %d slots, %d trainer workers",
            len(self.launcher.handles),
            len(self.trainer_devices),
        )

    async def _prebuild_roles(self) -> None:
        """In a mode that moves devices, build the roles each slot may take later and
        park them (memory released, a host copy kept), before the trainer loads its
        state: the first move onto a slot then resumes a role instead of building one
        (seconds on CPU; a server launch with SGLang). Slots that start with a role
        build it next, as the initial placement says. With ``rollout.tail_tp`` in the
        dynamic mode, the engines of the tail's size are built first, on every aligned
        group of that size (those that start with a role included): a regroup then
        resumes them. One build at a time per device: each takes its device's memory
        until it is released."""
        if self.cfg.scheduler.mode == "static-disaggregated":
            return
        placed = {
            n.devices[0]
            for c in (ROLLOUT, INFERENCE)
            if c in self.graph.components
            for n in self.graph.components[c].active_instances()
        }
        with_inference = INFERENCE in self.graph.components
        tail = self.cfg.rollout.tail_tp if self.cfg.scheduler.mode == "dynamic" else 0

        async def park(device: DeviceId, roles: Sequence[RolloutRole | InferenceRole]) -> None:
            slot = self.slot(device)
            for role in roles:
                await slot.build_role(role, instance=InstanceId(slot.name))
                await slot.release_memory(host_backup=True)

        if tail:
            async with anyio.create_task_group() as tg:
                for device in self.slot_devices:
                    if (wide := self.led_group(device, tail)) is not None:
                        tg.start_soon(park, device, [self.rollout_role(wide)])
        async with anyio.create_task_group() as tg:
            for device in self.slot_devices:
                if device in placed:
                    continue
                roles: list[RolloutRole | InferenceRole] = []
                if (group := self.led_group(device, self.cfg.rollout.tp)) is not None:
                    roles.append(self.rollout_role(group))
                if with_inference:
                    roles.append(self.inference_role(device))
                tg.start_soon(park, device, roles)

    def led_group(self, device: DeviceId, size: int) -> list[DeviceId] | None:
        """The aligned group of ``size`` devices ``device`` leads, if all are slots'.
        A rollout engine is led by the first device of its group: prebuilt where the
        device leads an aligned group, on that group (a move onto other devices builds
        the engine then)."""
        group = [DeviceId(device + k) for k in range(size)]
        return group if device % size == 0 and set(self.slot_devices).issuperset(group) else None

    async def aclose(self) -> None:
        """Stop the trainer, then the slots; idempotent, and finishes even when
        the caller is cancelled (no process outlives it)."""
        with anyio.CancelScope(shield=True):
            if self.trainer is not None:
                trainer, self.trainer = self.trainer, None
                await trainer.aclose()
            await self.launcher.aclose()

    # ------------------------------------------------------------------ slot roles

    async def assume(
        self,
        component: ComponentId,
        instances: Sequence[tuple[Sequence[DeviceId], InstanceId]],
        *,
        hold: bool = True,
    ) -> None:
        """Make the slots of ``instances``' first devices serve ``component`` (rollout
        or inference) as those instances, each on its devices: the roles are built (or
        resumed) side by side, brought to the weights the engines run in one
        broadcast, and only then connected. With ``hold`` the router routes nothing to
        them until ``router.reactivate`` (once the controller has placed them)."""
        if component not in (ROLLOUT, INFERENCE):
            raise ValueError(f"slots serve rollout or inference, not {component}")

        def role_of(devices: Sequence[DeviceId]) -> RolloutRole | InferenceRole:
            if component == ROLLOUT:
                return self.rollout_role(devices)
            return self.inference_role(devices[0])

        slots = [
            (self.slot(devices[0]), instance, role_of(devices)) for devices, instance in instances
        ]
        for listener in self.switch_listeners:
            listener(component, [slot for slot, _, _ in slots])
        try:
            await self._assume(slots, hold=hold)
        except BaseException:
            # A slot that died taking the role is not serving, so the router's report
            # of it forgets nothing: record it, so the next move onto its device
            # reboots it (starts a new slot process) instead of failing there again.
            for slot, _, _ in slots:
                if not slot.alive and slot.name not in self.lost:
                    self.lost.add(slot.name)
                    logger.warning("slot %s died taking the %s role", slot.name, component)
            raise

    async def _assume(
        self,
        slots: list[tuple[SlotHandle, InstanceId, RolloutRole | InferenceRole]],
        *,
        hold: bool,
    ) -> None:
        # One at a time with other membership changes of the weight-sync group: a slot
        # must not be reconnecting while the group is rebuilt around it.
        async with self.weights.lock:
            for slot, _, role in slots:
                if not isinstance(role, RolloutRole):
                    continue
                built = slot.rollout_roles.get(len(role.engine_devices))
                if built is not None and built != role:
                    # The slot closes its engine of that size on other devices for a new one.
                    self.weights.engine_replaced(slot.name, built.engine_devices)
            async with anyio.create_task_group() as tg:
                for slot, instance, role in slots:
                    tg.start_soon(functools.partial(slot.build_role, role, instance=instance))
            await self.weights.bring_up_to_date([slot for slot, _, _ in slots])
            if hold:
                for _, instance, _ in slots:
                    self.router.hold(instance)

            async def connect(slot: SlotHandle, instance: InstanceId) -> None:
                await slot.connect_role()
                self._serving[instance] = slot

            async with anyio.create_task_group() as tg:
                for slot, instance, _ in slots:
                    tg.start_soon(connect, slot, instance)

    async def release(self, instance: InstanceId) -> SlotHandle | None:
        """Stop ``instance`` (a rollout engine or an inference worker) and free its
        slot's memory for another component: its queued and in-flight requests go
        back to the router with their partial output (a batch of samples being scored
        finishes first). The slot keeps a host copy of the role, to resume it later
        (:meth:`restore`). Returns the slot."""
        await self.router.drain(instance)
        slot = self._serving.pop(instance, None)
        if slot is not None:
            await slot.release_memory(host_backup=True)
        return slot

    async def restore(self, instance: InstanceId, slot: SlotHandle) -> None:
        """Undo :meth:`release` (the move it was part of failed): the slot resumes the
        role's memory and the router routes to ``instance`` again."""
        await slot.resume_memory()
        self._serving[instance] = slot
        self.router.reactivate(instance)

    def forget(self, instance: InstanceId) -> None:
        """``instance``'s worker died (the router reported it; its items were routed
        elsewhere): forget its slot. The weight-sync group it was in is abandoned, not
        left (leaving is collective and would wait on the dead member until the
        group's timeout): the next sync builds a new group of the survivors, whose
        members replace their old group by joining it."""
        slot = self._serving.pop(instance, None)
        if slot is None:
            # Released by a move (no longer serving: a weight sync leaves it out),
            # or dying as its move released it: still the slot of that instance.
            slot = next((h for h in self.launcher.handles if h.instance == instance), None)
        if slot is None:
            return
        if slot.name not in self.lost:
            self.lost.add(slot.name)
            logger.warning("slot %s (%s) died; the run goes on without it", slot.name, instance)
        self.weights.member_died(slot.name)

    def fail(self, error: BaseException) -> None:
        """The world cannot go on (``error``: a trainer rank died); tell the run once."""
        if self.failure is not None:
            return
        self.failure = error
        logger.error("the run cannot go on: %s", error)
        if self.on_failure is not None:
            self.on_failure(error)

    # ------------------------------------------------------------------ the actor

    @contextlib.asynccontextmanager
    async def actor_boundary(self) -> AsyncIterator[float]:
        """Wait for an optimizer-step boundary and hold it (no step runs meanwhile);
        yields the seconds waited."""
        assert self.trainer is not None, "start the world first"
        started = time.perf_counter()
        async with self.trainer.between_steps():
            yield time.perf_counter() - started

    async def resize_actor(
        self, *, leaving: Sequence[DeviceId] = (), joining: Sequence[DeviceId] = ()
    ) -> None:
        """Take the trainer's ranks off ``leaving`` and onto ``joining``
        (create-before-destroy; raises with the old ranks in place on failure). With no
        device left the trainer is parked. Call inside :meth:`actor_boundary`."""
        trainer = self.trainer
        assert trainer is not None, "start the world first"
        gone = set(self.trainer_members(leaving))
        staying = [m for m in trainer.members if m not in gone]
        members = staying + [m for m in self.trainer_members(joining) if m not in staying]
        try:
            if members:
                for listener in self.resize_listeners:
                    listener(tuple(members))
                await trainer.resize(tuple(members))
            elif not trainer.parked:
                await trainer.park()
        finally:
            self._route_to_ranks()

    def _route_to_ranks(self) -> None:
        """Only the trainer's ranks take the actor's samples: the router holds the
        other trainer workers, so the samples of a rank that dies go to the surviving
        ranks (they re-run its step) and never to a worker that is not training."""
        assert self.trainer is not None, "start the world first"
        ranks = set(self.trainer.rank_instances())
        connected = set(self.router.instances)
        for name in map(InstanceId, self.trainer_names):
            if name in ranks and name in connected:
                self.router.reactivate(name)
            elif name in connected:
                self.router.hold(name)
