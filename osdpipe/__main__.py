from osdpipe.cli import main

main()
