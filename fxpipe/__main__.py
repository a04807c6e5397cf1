"""`python -m fxpipe` runs the command line."""
import sys

from fxpipe.cli import main

sys.exit(main())
