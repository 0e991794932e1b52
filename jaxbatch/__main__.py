"""`python -m jaxbatch serve ...`: the same as the `jaxbatch` console script (jaxbatch/cli.py)."""
import sys

from jaxbatch.cli import main

sys.exit(main())
