"""How taproute is hosted: the runtime thread and its ingress (``runtime``),
the service object composing it with HTTP and the operator controls
(``service``), config files, HTTP (metrics, status, operator endpoints) and
the ``taproute`` command."""
