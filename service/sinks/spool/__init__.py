"""A durable spool per destination: batches on local disk while it can't take them."""

from taproute.service.sinks.spool.config import FsyncPolicy, SpoolConfig, WhenFull
from taproute.service.sinks.spool.log import Damage
from taproute.service.sinks.spool.spool import Spool, SpoolCounters, Spooled, SpoolFull

__all__ = [
    "Damage",
    "FsyncPolicy",
    "Spool",
    "SpoolConfig",
    "SpoolCounters",
    "SpoolFull",
    "Spooled",
    "WhenFull",
]
