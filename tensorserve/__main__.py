import sys

from tensorserve.cli import main

sys.exit(main())
