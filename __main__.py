import sys

from dsv4c.cli import main

sys.exit(main())
