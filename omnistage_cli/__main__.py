"""`python -m omnistage_cli`: the `omnistage` command without its console script."""

import sys

from omnistage_cli.main import main

sys.exit(main())
