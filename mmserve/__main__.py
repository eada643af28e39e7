"""`python -m mmserve` runs the command line."""

from mmserve.cli import main

raise SystemExit(main())
