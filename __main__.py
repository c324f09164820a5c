"""`python -m deepinfer ...` (and `torchrun ... -m deepinfer generate ...`): the CLI."""
import sys

from .cli import main

sys.exit(main())
