import sys

from edge_infer.cli import main

sys.exit(main())
