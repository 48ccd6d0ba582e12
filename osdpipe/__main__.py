from osdpipe.entry import main

main()
