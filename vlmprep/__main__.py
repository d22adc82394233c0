from vlmprep.cli import main

main()
