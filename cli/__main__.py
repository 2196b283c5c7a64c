import sys

from opentinker.cli.main import main

sys.exit(main())
