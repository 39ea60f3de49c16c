# -*- test-case-name: tests.test_admin -*-
"""C{python -m nvproxy.ctl}: the same as the C{nvproxyctl} console script."""

import sys

from nvproxy.ctl import main

sys.exit(main())
