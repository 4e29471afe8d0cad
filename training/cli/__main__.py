"""``python -m moefold.training.cli ...`` (what torchrun runs): the ``moefold`` command."""

import sys

from moefold.training.cli import main

sys.exit(main())
