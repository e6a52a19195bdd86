"""`python -m services.cli`: the `splitstack` command."""
import sys

from services.cli import main

sys.exit(main())
