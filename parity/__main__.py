"""`python -m parity` is `fp8-parity`."""

import sys

from parity.cli import main

sys.exit(main())
