"""`python -m cacheproxy`."""

from cacheproxy.cli.main import main

main()
