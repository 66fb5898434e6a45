#!/usr/bin/env python3
"""The latency sweep (same as `dxpu lab sweep`): workloads at several injected delays, the
performance model fitted on some delays and checked on the others, plots and JSON.

    .venv/bin/python scripts/sweep.py [--delays 0,100,250,500,1000] [--calibration 0,250,1000] [--out results/sweep]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dxpu_vfio.cli import main  # noqa: E402

sys.exit(main(["lab", "sweep", *sys.argv[1:]]))
