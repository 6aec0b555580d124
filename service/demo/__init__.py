"""The MiniLM demo behind ``taproute demo``.

Importing this package registers nothing: the demo's processors register when
:mod:`taproute.service.demo.processors` is imported (``taproute demo`` does it,
and so does a config file that lists it under ``processors``).
"""
