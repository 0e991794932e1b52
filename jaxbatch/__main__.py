"""`python -m jaxbatch serve|bench ...`: the same as the `jaxbatch` console script (jaxbatch/entrypoints/cli.py)."""
import sys

from jaxbatch.entrypoints.cli import main

sys.exit(main())
