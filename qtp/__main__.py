import sys

from qtp.cli import main

sys.exit(main())
