"""The Megatron trainer worker process's entry, light to import: it sets the thread
count before torch loads, then serves with a
:class:`~dynarl.workers.megatron.worker.MegatronWorker`."""

import logging
import os

import anyio

from dynarl.workers.process import exit_process, ignore_interrupts, watch_parent

logger = logging.getLogger(__name__)


def megatron_trainer_main(endpoint: str, name: str, num_threads: int) -> None:
    """Process entry of Megatron trainer worker ``name``: as the torch backend's
    (:func:`~dynarl.workers.torch.trainer_main.trainer_main`), whose serving loop it
    runs with the Megatron worker's ``join``."""
    watch_parent()
    ignore_interrupts()
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # before torch is imported
    import torch

    from dynarl.workers.megatron.worker import join
    from dynarl.workers.torch.trainer_serve import serve

    torch.set_num_threads(num_threads)
    code = 0
    try:
        anyio.run(serve, endpoint, name, join)
    except BaseException:
        logger.exception("megatron trainer worker %s failed", name)
        code = 1
    exit_process(code)
