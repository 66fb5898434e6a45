"""``python -m dxpu_vfio.hostproxy``: see :mod:`dxpu_vfio.hostproxy.main`."""

import sys

from dxpu_vfio.hostproxy.main import main

sys.exit(main())
