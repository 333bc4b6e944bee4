import sys

from engine.proxy.cli import main

sys.exit(main())
