"""Reloading a running service from its config file.

:class:`ConfigReloader` re-reads the file a service was built from and swaps
its routes for the file's new ones, as a new configuration generation (see
:meth:`~taproute.service.host.runtime.RecordRuntime.reload`).  ``taproute
run`` calls it on SIGHUP, the HTTP endpoint on ``POST /reload`` (bearer
token); a program may call it too.

A reload applies the routes, ``[routing]`` and ``processors`` of the file.
The other sections are fixed for the life of the service (layouts are what
producers bind with; destinations, ingress, HTTP and the dead-letter store
are open resources): a file that changes one of them is refused, naming
each, together with every problem of the new routes, and the running
generation goes on.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from taproute.actors.generation import Generation
from taproute.actors.routing_sink import RoutingSink
from taproute.routing.errors import ConfigError
from taproute.service.host.config import ConfigFileError, ServiceConfig, load_config, plan_problems

if TYPE_CHECKING:
    from taproute.service.host.service import RecordService

#: Sections a reload cannot change (restart to apply them).
FIXED_SECTIONS = ("layouts", "destinations", "ingress", "http", "dead_letters", "producer")


def fixed_section_problems(running: ServiceConfig, candidate: ServiceConfig) -> list[str]:
    """One line per section ``candidate`` changes that a reload cannot apply."""
    return [
        f"{name}: differs from the running configuration; a reload applies routes, "
        f"[routing] and processors only (restart to apply {name})"
        for name in FIXED_SECTIONS
        if getattr(running, name) != getattr(candidate, name)
    ]


class ConfigReloader:
    """Reloads ``service`` (built from ``config``) from ``config.source``, re-read
    at each call; thread-safe, one reload at a time.

    ``call_timeout``: the ``--call-timeout`` the service was started with,
    applied to every reloaded file as it was to the first.  Calling it returns
    the new generation's number, or raises :class:`ConfigFileError` listing
    every problem (the file's own, fixed sections changed, the new routes'
    build problems, each at its key path).
    """

    def __init__(
        self,
        service: RecordService,
        config: ServiceConfig,
        *,
        call_timeout: float | None = None,
    ) -> None:
        sink = service.record_sink
        if not isinstance(sink, RoutingSink):
            raise TypeError("a config file's service routes through a RoutingSink")
        self._service = service
        self._sink = sink
        #: The configuration of the running generation.
        self.config = config
        self.call_timeout = call_timeout
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            candidate = load_config(self.config.source)
            if self.call_timeout is not None:
                candidate = candidate.with_call_timeout(self.call_timeout)
            problems = fixed_section_problems(self.config, candidate)
            try:
                candidate.import_processors()
            except ConfigFileError as exc:  # listed with the rest (its routes then fail too)
                problems += exc.problems
            generation: Generation | None = None
            try:
                generation = self._sink.prepare(
                    candidate.routing_config(),
                    default_destination=candidate.routing.default_destination,
                    unmatched=candidate.routing.unmatched,
                )
            except ConfigFileError as exc:
                problems += exc.problems
            except ConfigError as exc:
                problems += plan_problems(exc)
            if problems:
                if generation is not None:
                    generation.detach()
                raise ConfigFileError(candidate.source, problems)
            assert generation is not None
            number = self._service.swap(generation)
            self.config = candidate
            return number


__all__ = ["FIXED_SECTIONS", "ConfigReloader", "fixed_section_problems"]
