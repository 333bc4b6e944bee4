import sys

from syncd.engine.proxy.cli import main

sys.exit(main())
