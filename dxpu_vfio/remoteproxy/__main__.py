"""``python -m dxpu_vfio.remoteproxy``: see :mod:`dxpu_vfio.remoteproxy.main`."""

import sys

from dxpu_vfio.remoteproxy.main import main

sys.exit(main())
