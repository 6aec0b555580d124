"""What a config file builds: :class:`BuiltService`, the routing sink and how
to host it (started by :meth:`BuiltService.start`)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

import attrs

from taproute.actors import RoutingSink
from taproute.service.host.http import HttpConfig
from taproute.service.host.service import RecordService, create_record_runtime
from taproute.service.ops.dead_letters import DeadLetterStore

if TYPE_CHECKING:
    from taproute.service.host.config import ServiceConfig


@attrs.frozen(kw_only=True)
class BuiltService:
    """What a config builds: the routing sink and how to host it.

    Nothing runs until :meth:`start`.  A context manager: leaving it closes the
    dead-letter store (after the service, if one was started, closed).  To host
    it differently, ``attrs.evolve`` it (``attrs.evolve(built, http=None)``).
    """

    config: ServiceConfig
    sink: RoutingSink
    http: HttpConfig | None
    dead_letters: DeadLetterStore | None

    def start(self) -> RecordService:
        """Start the service: ingress as configured, HTTP if configured; it
        reloads from the config file on ``POST /reload`` (``service.reloader``)."""
        from taproute.service.host.reload import ConfigReloader  # it imports the config

        ingress = self.config.ingress
        service = create_record_runtime(
            record_sink=self.sink,
            capacity_records=ingress.capacity_records,
            capacity_bytes=ingress.capacity_bytes,
            when_full=ingress.when_full,
            max_block=ingress.max_block,
            shutdown_grace=self.config.shutdown.grace,
            http=self.http,
            dead_letters=self.dead_letters,
        )
        service.reloader = ConfigReloader(service, self.config)
        return service

    def close(self) -> None:
        """Close the dead-letter store."""
        if self.dead_letters is not None:
            self.dead_letters.close()

    def __enter__(self) -> BuiltService:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
