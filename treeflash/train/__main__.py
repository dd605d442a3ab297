import sys

from treeflash.train.cli import main

sys.exit(main())
