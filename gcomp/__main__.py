import sys

from gcomp.cli import main

sys.exit(main())
