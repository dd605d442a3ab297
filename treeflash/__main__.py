import sys

from treeflash.cli import main

sys.exit(main())
