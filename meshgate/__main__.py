import sys

from meshgate.cli import main

sys.exit(main())
