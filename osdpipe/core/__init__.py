"""The lowest layer: small helpers every layer uses, importing nothing else of osdpipe.

The registry lookup, sizes as people write them, bitwise comparison, memory
accounting, the fork server that ranks and probes start from, the version.
"""
