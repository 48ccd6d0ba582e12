"""Layer 2, pure layout math and what it describes: where every element of every parameter lives on every rank.

Ranges of flattened parameters and N-D boxes, the module tree and its state-dict
keys, tensor-parallel placements, the layout kinds (none, DDP, FSDP1, FSDP2),
ZeRO partitions, param-ID mapping, synthetic values; and the models and
optimizers these describe. No files and no process group: imports only
:mod:`osdpipe.core`.
"""
