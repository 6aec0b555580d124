"""``taproute demo`` and ``taproute run``: drive a model or a configured router."""

from __future__ import annotations

import socket
from pathlib import Path

from taproute.service.host.cli.errors import CommandError
from taproute.service.host.config import ConfigFileError, ServiceConfig, load_config
from taproute.service.host.http import HttpConfig


def demo(sentences: int, data: Path, serve: bool, port: int) -> int:
    """Run all-MiniLM-L6-v2 with its captures routed into chDB (see taproute.service.demo)."""
    from taproute.service.demo import run as minilm_demo

    _check_data_directory(data)
    http = HttpConfig(port=port) if serve else None
    minilm_demo.run(data=data, count=sentences, http=http, serve_forever=serve)
    return 0


def _check_data_directory(data: Path) -> None:
    """Refuse, in one line and before the model loads, a ``--data`` that chDB
    cannot use: not a directory (or not creatable), or held by another process."""
    from taproute.service.host.config_destinations import chdb_holder

    try:
        data.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = "exists and is not a directory" if isinstance(exc, FileExistsError) else exc
        raise CommandError(f"--data {data}: cannot create the directory: {reason}", 2) from None
    holder = chdb_holder(data)
    if holder is not None:
        raise CommandError(f"--data {data}: chDB directory in use by process {holder}", 2)


def run(path: Path, rate: float, duration: float, call_timeout: float | None = None) -> int:
    """Drive the configured router from a synthetic producer while serving HTTP."""
    from taproute.service.host.loadgen import run_load

    config = load_config(path)
    if call_timeout is not None:
        config = config.with_call_timeout(call_timeout)
    http = config.http if config.http is not None else HttpConfig()
    _check_listen(config, http)
    counters = run_load(
        config, rate=rate, duration=duration, call_timeout=call_timeout, summary=True
    )
    return 0 if counters.failure is None else 1


def _check_listen(config: ServiceConfig, http: HttpConfig) -> None:
    """Refuse an HTTP address that can't be listened on before anything starts."""
    if http.port == 0:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in http.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((http.host, http.port))
    except OSError as exc:
        where = "http.port" if config.http is not None else "http.port (default)"
        raise ConfigFileError(
            config.source,
            [f"{where}: cannot listen on {http.host}:{http.port}: {exc.strerror or exc}"],
        ) from None
