"""``python -m stage0_tiny``: tiny.py's main (generate, time it with two thread counts, check against HF)."""

from .tiny import main

raise SystemExit(main())
