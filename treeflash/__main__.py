from treeflash.cli import entry

entry()
