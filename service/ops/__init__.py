"""Operators' tools: the SQLite dead-letter store (``dead_letters``), the controls
over it (``controls``: skip, reroute) and their HTTP endpoints with ``/trace``
(``endpoints``), which the host's HTTP app mounts."""
