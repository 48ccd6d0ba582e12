"""Layer 3, checkpoints on disk: reading and writing them, and what their files show.

The formats, the framework checkpoint layouts, the torch-file writer,
safetensors, digests, the output directory's commit, the facts files show of
themselves, and loading a converted file into a job. Imports only the layers
below (:mod:`osdpipe.layout`, :mod:`osdpipe.core`).
"""
