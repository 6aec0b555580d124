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

import hashlib
import threading
import tomllib
import typing
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from cattrs.errors import ClassValidationError

from taproute.actors.generation import Generation
from taproute.actors.routing_sink import RoutingSink
from taproute.routing.errors import ConfigError
from taproute.service.host.config import ConfigFileError, ServiceConfig, load_config, plan_problems
from taproute.service.host.config_rules import CONVERTER

if TYPE_CHECKING:
    from taproute.service.host.service import RecordService

#: Sections a reload cannot change (restart to apply them).
FIXED_SECTIONS = ("layouts", "destinations", "ingress", "http", "dead_letters", "producer")


def fixed_section_problems(running: ServiceConfig, candidate: ServiceConfig) -> list[str]:
    """One line per section ``candidate`` changes that a reload cannot apply."""
    return [
        _changed(name)
        for name in FIXED_SECTIONS
        if getattr(running, name) != getattr(candidate, name)
    ]


def unloadable_file_fixed_section_problems(
    running: ServiceConfig, path: Path, data: bytes | None = None
) -> list[str]:
    """For a file that does not load (a bad value anywhere): one line per fixed
    section it changes, of those that read on their own, so that the refusal
    lists them with the file's own problems. A section with problems of its
    own is left out (load_config lists those).  ``data``: the file's bytes,
    already read."""
    try:
        raw = tomllib.loads((path.read_bytes() if data is None else data).decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []  # nothing of it can be read: load_config said why
    types = typing.get_type_hints(ServiceConfig)
    fields = attrs.fields_dict(ServiceConfig)
    problems: list[str] = []
    for name in FIXED_SECTIONS:
        default = fields[name].default
        if name in raw:
            try:
                value = CONVERTER.structure(raw[name], types[name])
            except (ClassValidationError, ConfigError, TypeError, ValueError):
                continue  # its own problems, listed by load_config
        elif isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            value = typing.cast(typing.Any, default).factory()
        elif default is attrs.NOTHING:
            continue  # a required section missing: listed by load_config
        else:
            value = default
        if getattr(running, name) != value:
            problems.append(_changed(name))
    return problems


def _changed(name: str) -> str:
    return (
        f"{name}: differs from the running configuration; a reload applies routes, "
        f"[routing] and processors only (restart to apply {name})"
    )


class ConfigReloader:
    """Reloads ``service`` (built from ``config``) from ``config.source``, re-read
    at each call; thread-safe, one file read and check at a time.

    ``call_timeout``: the ``--call-timeout`` the service was started with,
    applied to every reloaded file as it was to the first.  Calling it returns
    the new generation's number, or raises :class:`ConfigFileError` listing
    every problem (the file's own, fixed sections changed, the new routes'
    build problems, each at its key path).  The new generation routes the
    records submitted after the call: the call returns once those submitted
    before it were handed on, which on a saturated router is what its
    ingress holds (:meth:`queue` does not wait for that).
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
        return self.queue().result()

    def queue(self, timeout: float | None = None) -> Future[int]:
        """Read and check the file, build its generation, and queue the swap
        behind the records submitted before; returns without waiting for the
        swap: the future gives the new generation's number once it routes, or
        raises why the swap refused it.  A file with problems raises
        :class:`ConfigFileError` here, and nothing is queued.

        The swap's control takes one record's ingress room: while ingress is
        full this waits for room at most ``timeout`` seconds (None: no
        bound); past it the future raises ``NotQueued`` (a
        :class:`TimeoutError`) and nothing was queued.

        Whatever comes of it is kept in the service's snapshot
        (``counters().last_reload``: the file, the SHA-256 of the bytes
        checked, the outcome and why; ``/status``), a refusal at the swap
        included when nobody waits for the future any more; the future's
        ``reload_id`` is its ``id`` there."""
        with self._lock:
            path = self.config.source
            try:
                data: bytes | None = path.read_bytes()
            except OSError:
                data = None  # load_config says why
            ledger = self._service.reload_ledger
            running = self._service.generation
            digest = None if data is None else hashlib.sha256(data).hexdigest()
            routes: list[str] = []

            def asked() -> int:
                return ledger.asked(
                    running_generation=running,
                    routes=routes,
                    source=str(path),
                    config_sha256=digest,
                )

            try:
                candidate, generation = self._checked(path, data, routes)
            except ConfigFileError as exc:
                ledger.refused(asked(), exc)
                raise
            reload_id = asked()
            swap = self._service.queue_swap(generation, timeout=timeout, reload_id=reload_id)
        outcome = QueuedReload(reload_id)

        def swapped(done: Future[int]) -> None:
            # Where the swap ran (the loop thread), or here: must never raise.
            # The config is the new one before the caller learns the number
            # (every accepted file has the running fixed sections, so a check
            # made meanwhile compares against the same ones).
            error = done.exception()
            if error is not None:
                outcome.set_exception(error)
            else:
                self.config = candidate
                outcome.set_result(done.result())

        swap.add_done_callback(swapped)
        return outcome

    def _checked(
        self, path: Path, data: bytes | None, routes: list[str]
    ) -> tuple[ServiceConfig, Generation]:
        """The file (``data``: its bytes, None: unreadable) loaded and checked,
        and its generation built; :class:`ConfigFileError` with every
        problem.  ``routes`` gets the names of its routes once it loaded."""
        try:
            candidate = load_config(path, data=data)
        except ConfigFileError as exc:
            changed = unloadable_file_fixed_section_problems(self.config, path, data)
            raise ConfigFileError(exc.path, changed + exc.problems) from None
        routes += [route.name for route in candidate.routes]
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
        return candidate, generation


class QueuedReload(Future[int]):
    """The future :meth:`ConfigReloader.queue` returns: its ``reload_id`` is the
    reload's ``id`` in the service's snapshot (``counters().reloads``)."""

    def __init__(self, reload_id: int) -> None:
        super().__init__()
        self.reload_id = reload_id


__all__ = [
    "FIXED_SECTIONS",
    "ConfigReloader",
    "QueuedReload",
    "fixed_section_problems",
    "unloadable_file_fixed_section_problems",
]
