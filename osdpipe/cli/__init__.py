"""The top layer: the ``osdpipe`` command, Hydra composition, ``inspect``, ``check``, sweeps."""
