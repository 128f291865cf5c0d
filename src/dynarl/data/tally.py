"""A count several containers keep together: the items they hold between them.

A component's request queues share one :class:`Tally`, its workers' in-flight maps
another (:class:`~dynarl.data.component_peers.ComponentPeers`), so the placement can
tell in O(1), after every batch of results, that no instance queues anything another
could take, or that the one with room already holds its fair share, without visiting
each instance.
"""


class Tally:
    """How many items the containers counted in it hold together."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0
