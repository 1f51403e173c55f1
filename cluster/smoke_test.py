#!/usr/bin/env python
"""Cluster smoke test (same as ``ray-moe smoke``): see :mod:`ray_moe.ops.smoke`.

    python cluster/smoke_test.py --address HOST:PORT [--json smoke.json] [--world-size W]
"""

import sys

from ray_moe.ops.smoke import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
