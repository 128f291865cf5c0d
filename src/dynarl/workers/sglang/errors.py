"""Errors of the SGLang backend; all derive from :class:`dynarl.core.errors.DynaRLError`."""

from dynarl.workers.errors import WorkerError


class SGLangError(WorkerError):
    """Root of the SGLang backend's errors."""


class ServerError(SGLangError):
    """The server answered a call with an error (after any retries); the message
    gives the endpoint, the status and the server's own message.

    Attributes:
        status: the HTTP status (0 when no answer came: timeout, refused connection).
    """

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class ServerLostError(SGLangError):
    """The server stopped answering (it died, or its connection broke mid-stream);
    its requests were handed back with their partial output."""


class ProtocolMismatchError(SGLangError):
    """The server does not speak the protocol this adapter was written for (another
    SGLang version, not a generation model, or a response it cannot decode)."""


class LaunchFailedError(SGLangError):
    """A server process exited, or did not become healthy, while starting; the
    message says which and where its log is."""
