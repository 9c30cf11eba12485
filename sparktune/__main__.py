"""``python -m sparktune``: the command line."""

from .cli import main

raise SystemExit(main())
