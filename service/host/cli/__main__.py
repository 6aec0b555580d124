"""``python -m taproute.service.host.cli``: the ``taproute`` command."""

import sys

from taproute.service.host.cli.main import main

sys.exit(main())
