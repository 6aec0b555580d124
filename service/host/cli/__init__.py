"""The ``taproute`` command (``main``): one module per subcommand, the parser
and dispatch in ``main.py``, exit codes and error reporting in ``errors.py``."""

from taproute.service.host.cli.main import main

__all__ = ["main"]
