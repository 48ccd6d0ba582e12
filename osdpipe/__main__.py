from osdpipe.cli.entry import main

main()
