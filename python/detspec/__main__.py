import sys

from detspec.cli import main

sys.exit(main())
