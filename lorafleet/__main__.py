import sys

from lorafleet.cli import main

sys.exit(main())
