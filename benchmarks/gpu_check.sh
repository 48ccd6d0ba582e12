#!/usr/bin/env bash
# What a GPU machine can check that CPU machines cannot (issue 38): the osdpipe command on NCCL with CUDA tensors,
# FSDP1 and FSDP2 sources made on the GPU, converted, loaded back on the GPU and resumed; whether FSDP1's gather
# gives exp_avg == exp_avg_sq there too; and the 1.6 GB benchmark row. Under 5 minutes on one GPU.
#   bash benchmarks/gpu_check.sh            (from the repository root, osdpipe installed)
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/gpu_check.py
python benchmarks/checkpoint_scale.py --sizes 1.6 --pairs 4:2 --repeats 1 --paths osdpipe,osdpipe-offline,osdpipe-dcp,limit
