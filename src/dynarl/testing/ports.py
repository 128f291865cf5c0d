"""Free TCP ports on localhost, for tests that start servers, process groups or
rendezvous stores of their own."""

import contextlib
import socket


def free_port(num: int = 1) -> int:
    """A port free on localhost now, and the ``num - 1`` after it (a process group's
    store, or servers launched on ``port_base + slot index``, bind them).

    Free when probed: another process may take it before the caller binds it, so a
    test that cannot tolerate that retries on a bind error.
    """
    while True:
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            try:
                for k in range(1, num):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port + k))
            except OSError:
                continue  # one after it is taken: try another
            return port
