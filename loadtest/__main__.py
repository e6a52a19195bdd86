"""`python -m loadtest`: the load generator's command line (the same as `splitstack loadtest`)."""
import sys

from loadtest.cli import main

sys.exit(main())
