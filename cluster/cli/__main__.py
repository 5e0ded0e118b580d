"""`python -m cluster.cli ARGS` = `duet ARGS`."""

import sys

from cluster.cli.main import main

sys.exit(main())
