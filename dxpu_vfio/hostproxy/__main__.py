import sys

from dxpu_vfio.hostproxy.process import main

sys.exit(main())
