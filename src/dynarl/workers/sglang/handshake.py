"""What the SGLang adapter checks of a server before it serves: the SGLang version
(its HTTP API, and flattened-bucket weight updates), a generation model, the context
length, the weight version it holds, and the requests it runs at once."""

import re
from collections.abc import Callable
from typing import Any

from dynarl.workers.sglang import messages as m
from dynarl.workers.sglang.errors import ProtocolMismatchError

SUPPORTED_VERSIONS = ("0.5.",)
"""SGLang versions whose HTTP API this adapter speaks (prefixes of ``version``)."""

MIN_VERSION = (0, 5, 6)
"""The oldest SGLang that takes flattened buckets in ``/update_weights_from_distributed``
(sgl-project/sglang#13824), the layout of dynarl's weight sync."""


def weight_version_of(text: str | None) -> int:
    """dynarl's integer version of SGLang's ``weight_version`` string (``"default"``
    before any update: 0)."""
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 0


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (``"0.5.6.post1"`` -> ``(0, 5, 6)``)."""
    parts = []
    for part in version.split(".")[:3]:
        digits = re.match(r"\d+", part)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts)


def check_server(get: Callable[[str, type[Any]], Any], url: str) -> tuple[m.ServerInfo, int, int]:
    """The server's info, context length and weight version, once it is known to speak
    this adapter's protocol; ``get(path, type)`` reads one endpoint, decoded.

    Raises:
        ProtocolMismatchError: another SGLang version, or not a generation model.
    """
    info: m.ServerInfo = get("/get_server_info", m.ServerInfo)
    if not info.version.startswith(SUPPORTED_VERSIONS) or _release(info.version) < MIN_VERSION:
        raise ProtocolMismatchError(
            f"the SGLang server at {url} is version {info.version}; this adapter speaks "
            f"the HTTP API of SGLang {', '.join(v + 'x' for v in SUPPORTED_VERSIONS)} from "
            f"{'.'.join(map(str, MIN_VERSION))} on: run one of those there"
        )
    model: m.ModelInfo = get("/get_model_info", m.ModelInfo)
    if not model.is_generation:
        raise ProtocolMismatchError(
            f"the SGLang server at {url} serves {model.model_path}, which is not a "
            f"generation model; serve the policy there"
        )
    cards: m.ModelList = get("/v1/models", m.ModelList)
    context = info.context_length or (cards.data[0].max_model_len if cards.data else None)
    if context is None:
        raise ProtocolMismatchError(f"the SGLang server at {url} reports no context length")
    return info, context, weight_version_of(model.weight_version)


def running_limit(info: m.ServerInfo) -> int | None:
    """Requests the server runs at once, as its ``/get_server_info`` says; ``None``
    when it does not say.

    SGLang's ``http_server.get_server_info`` spreads ``internal_states`` into its
    answer, one per data-parallel rank, each from ``Scheduler.get_internal_state``
    (``python/sglang/srt/managers/scheduler.py``, read at sgl-project/sglang
    ``0003215c``), which sets ``ret["effective_max_running_requests_per_dp"] =
    self.max_running_requests``: the limit the scheduler runs with after sizing its
    pools. The top-level ``max_running_requests`` is only the flag as given, so it is
    read when no rank reports its limit (the scheduler runs at most that many). With
    several ranks: the smallest rank's limit times the ranks (their sum would count
    on the server filling its larger ranks first, which it need not do).
    """
    limits = [state.effective_max_running_requests_per_dp for state in info.internal_states]
    if limits and all(limit is not None and limit > 0 for limit in limits):
        return min(limit for limit in limits if limit is not None) * len(limits)
    if info.max_running_requests is not None and info.max_running_requests > 0:
        return info.max_running_requests
    return None
