"""``python -m ray_moe.bench.layer ...`` (the same as ``ray-moe bench layer ...``)."""

import sys

from ray_moe.bench.layer import main

raise SystemExit(main(sys.argv[1:]))
