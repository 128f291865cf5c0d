"""The trainer worker process's entry, light to import: it sets the thread count
before torch loads, then serves (:mod:`dynarl.workers.torch.trainer_serve`)."""

import logging
import os

import anyio

from dynarl.workers.process import exit_process, ignore_interrupts, watch_parent

logger = logging.getLogger(__name__)


def trainer_main(endpoint: str, name: str, num_threads: int) -> None:
    """Process entry of trainer worker ``name``: connect to the controller's data router
    at ``endpoint`` and serve the pool's commands (:class:`Join` first) until told to
    shut down, retired, or cut off; exits with ``os._exit`` (see
    :func:`dynarl.workers.main.slot_main`), also when its parent dies."""
    watch_parent()
    ignore_interrupts()
    os.environ["OMP_NUM_THREADS"] = str(num_threads)  # before torch is imported
    import torch

    # The model code the pool's Join unpickles (transformers: seconds): imported while
    # the process starts, not while a restarted worker joins (the trainer waits then).
    import dynarl.workers.torch.model  # noqa: F401
    from dynarl.workers.torch.trainer_serve import serve

    torch.set_num_threads(num_threads)
    code = 0
    try:
        anyio.run(serve, endpoint, name)
    except BaseException:
        logger.exception("trainer worker %s failed", name)
        code = 1
    exit_process(code)
