"""How it runs: Trio actors under one nursery tree per routing sink.

- :class:`RoutingSink` / :func:`open_routing_sink`: the routing sink and its
  Trio-native form.
- :class:`Mailbox`, :class:`DestinationActor`, counters: the pieces it is built of
  (route actors: ``forward``, ``pool``, ``owners``, sharing ``route_actor`` and ``retry``).
"""

from taproute.actors.counters import (
    DestinationCounters,
    RouteCounters,
    RouterSnapshot,
)
from taproute.actors.destination import DestinationActor, DestinationSpec
from taproute.actors.mailbox import Mailbox
from taproute.actors.open_sink import open_routing_sink
from taproute.actors.routing_sink import RoutingSink

__all__ = [
    "DestinationActor",
    "DestinationCounters",
    "DestinationSpec",
    "Mailbox",
    "RouteCounters",
    "RouterSnapshot",
    "RoutingSink",
    "open_routing_sink",
]
