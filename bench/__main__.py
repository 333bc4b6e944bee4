"""``python -m bench``: the benchmark driver (``bench/_driver.py``)."""

import sys

from bench._driver import main

sys.exit(main())
