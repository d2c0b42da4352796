"""``python -m eqjax.cli``: the ``eqjax`` command."""

import sys

from eqjax.cli.main import main

sys.exit(main())
