"""An engine's generation rate from the tokens its streams deliver.

The SGLang adapter sees tokens only as they arrive, a chunk at a time per request;
each chunk carries the tokens generated since that request's previous one. Over a
window of recent arrivals, the tokens that arrived *after* the window's first
arrival were generated between it and now; the first arrival's own tokens were
generated before it, so they are left out (counting them overstates the rate by a
whole chunk: twice the true rate when a lone request's second chunk has just come).
"""

import collections


class ArrivalRate:
    """Tokens per second over the arrivals of the last ``window_s`` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()

    def arrived(self, now_s: float, tokens: int) -> None:
        """``tokens`` new tokens arrived at ``now_s``."""
        self._forget_before(now_s - self.window_s)
        self._arrivals.append((now_s, tokens))

    def rate(self, now_s: float) -> float:
        """Tokens per second from the window's first arrival to ``now_s``, that
        arrival's own tokens left out; 0 before a second arrival."""
        self._forget_before(now_s - self.window_s)
        arrivals = self._arrivals
        if len(arrivals) < 2:
            return 0.0
        span_s = now_s - arrivals[0][0]
        tokens = sum(count for _, count in arrivals) - arrivals[0][1]
        return tokens / span_s if span_s > 0 else 0.0

    def _forget_before(self, start_s: float) -> None:
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] < start_s:
            arrivals.popleft()
