"""`python -m cacheproxy`."""

from cacheproxy.cli import main

raise SystemExit(main())
