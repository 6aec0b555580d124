"""How taproute is hosted: the runtime thread and its ingress, config files,
HTTP (metrics, status, operator endpoints) and the ``taproute`` command."""
