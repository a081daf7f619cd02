import sys

from elastic_run import _main

sys.exit(_main(sys.argv))
