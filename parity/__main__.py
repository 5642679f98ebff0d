"""`python -m parity` is `fp8-parity`."""

import sys

from parity.entry import main

sys.exit(main())
