import sys

from batchline.bench.cli import standalone

sys.exit(standalone())
