"""``python -m services.cli``: the ``meshserve`` command (:func:`services.cli.main`)."""

import sys

from services.cli import main

sys.exit(main())
