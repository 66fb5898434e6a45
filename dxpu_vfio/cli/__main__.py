import sys

from dxpu_vfio.cli import main

sys.exit(main())
