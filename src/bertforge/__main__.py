import sys

from bertforge.cli import main

sys.exit(main())
