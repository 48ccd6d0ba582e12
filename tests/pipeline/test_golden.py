"""The redesign changed how osdpipe is built, not what it writes: fixed configs give the bytes recorded before it.

Each case runs through the ``osdpipe`` command (one driver process, see
``cli_driver.py``) and is compared with ``golden/outputs.json``: the sha256
of every file the conversion wrote (the generated source included), and the
manifest's ``content_sha256`` (what defines the converted bytes: versions,
conversion config, files, tensor digests). The digests were recorded with
``python tests/pipeline/test_golden.py --record`` on the tree before issue 17's
redesign, under the torch the README pins; they depend on torch's
serialization, so the test first checks that torch is that version.

To re-record after an intended change of output bytes, run the same command
and say why in the commit. Re-recorded three times since: for issue 18,
every manifest's config gained ``tp_size`` and ``tp_plan``, and an FSDP2
rank's ``dtensor`` table its mesh's dimension names; for issue 19, every
manifest's config gained ``checkpoint`` and ``output.model_format`` /
``max_shard_size`` (each ``content_sha256``; no data file changed); for
issue 20, osdpipe writes its torch files with its own archive writer
(:mod:`osdpipe.io.torchfile`: the same records and tensors, another zip
layout), so every ``rank_<r>.pt`` and ``optim.pt`` it writes changed, while
the generated sources (``torch.save``'s) and every DCP file did not; and
later for issue 20, osdpipe writes a ``dcp`` output's rank files itself
(the same items at the offsets ``.metadata`` records, each tensor archive
written by :mod:`osdpipe.io.torchfile`), so ``dcp_3``'s ``.distcp`` files and
``.metadata`` changed, and nothing else; for issue 30, every manifest's
config gained ``output.model_keys``, and a checkpoint's ``lr`` is no longer
copied into ``optim.lr`` (each ``content_sha256``; no data file changed); for
issue 32, every byte is hashed once: a torch file's digest is made of its
pieces' (each manifest gains ``digests`` and ``pieces``, and its ``files``
digests changed), and a torch file osdpipe writes keys its
``serialization_id`` on its records, no longer on its storages' sha256, so
each such file (``rank_<r>.pt``, ``optim.pt``, ``.distcp``) changed in that
record alone, each archive's (its 40 bytes and their CRC-32, compared byte by
byte); the generated sources, ``.metadata`` and every tensor did not; for
issue 39, every manifest's config gained ``source.pp_size``, ``target.pp_size``
and ``output.megatron_optim_format`` (each ``content_sha256``; no data file changed); for issue 40, every
manifest's config gained ``output.dtype`` (each ``content_sha256``; no data file changed); for Megatron's virtual
pipeline stages, every manifest's config gained ``source.vpp_size`` and ``target.vpp_size`` (each
``content_sha256``; no data file changed); for a mixture of experts (issue 85), every manifest's config gained
``source.ep_size`` and ``target.ep_size`` (each ``content_sha256``; no data file changed).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from helpers import run_cli_cases  # noqa: E402

#: End to end: it starts worlds, minutes in all (`python -m pytest -m "not slow"` leaves it out, for a quick loop; CI
#: runs it).
pytestmark = pytest.mark.slow

RECORD = Path(__file__).parent / "golden" / "outputs.json"

#: Fixed conversions over every output format, both FSDP versions, DDP, offline and a user's model.
CASES: dict[str, list[str]] = {
    "default": [],
    "fsdp2_rank_local_3": ["target.kind=fsdp2", "target.world_size=3"],
    "fsdp_full": ["output.format=fsdp_full", "source.use_orig_params=true"],
    "dcp_3": ["output.format=dcp", "target.world_size=3", "source.sharding_strategy=SHARD_GRAD_OP"],
    "plain": ["target.kind=none", "target.world_size=1", "output.format=plain"],
    "ddp_from_sharded": ["source.state_dict_type=sharded", "target.kind=ddp", "target.world_size=2"],
    "offline_fsdp1_4": [
        "runtime.mode=offline", "target.world_size=4", "target.use_orig_params=true", "model.factory=usermodel:make"
    ],
    "offline_dcp_hybrid": [
        "runtime.mode=offline", "target.world_size=4", "target.sharding_strategy=HYBRID_SHARD",
        "target.shard_group_size=2", "optim.name=AdamW",
    ],
}

#: Files that say how a run went (times, paths), not what it wrote.
RUN_RECORDS = ("report.json", "osdpipe.log", "manifest.json")
#: A generated DCP source is written by PyTorch's own ``dcp.save``, whose ``.metadata`` differs run to run; its data
#: files do not.
PYTORCHS_OWN = "source/dcp/.metadata"


def digests(out: Path) -> dict[str, object]:
    files = {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in RUN_RECORDS and str(p.relative_to(out)) != PYTORCHS_OWN
    }
    manifest = json.loads((out / "manifest.json").read_text())
    return {"files": files, "content_sha256": manifest["content_sha256"]}


def run_cases(tmp: Path) -> dict[str, dict[str, object]]:
    cases = [[*args, f"output.path={tmp / name}", "runtime.progress=false"] for name, args in CASES.items()]
    results = run_cli_cases(cases, cwd=tmp, per_case_s=240)
    for name, result in zip(CASES, results):
        assert result["code"] == 0, f"{name}: {result['stderr']}"
    return {name: digests(tmp / name) for name in CASES}


def test_fixed_configs_write_the_bytes_recorded_before_the_redesign(tmp_path: Path) -> None:
    import torch

    recorded = json.loads(RECORD.read_text())
    assert torch.__version__ == recorded["torch"], (
        f"the digests were recorded under torch {recorded['torch']}; this is {torch.__version__}"
    )
    got = run_cases(tmp_path)
    for name in CASES:
        want = recorded["cases"][name]
        assert got[name]["files"] == want["files"], f"{name}: files differ from the recording"
        assert got[name]["content_sha256"] == want["content_sha256"], (
            f"{name}: the manifest's content differs from the recording"
        )


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        RECORD.write_text(
            json.dumps({"torch": torch.__version__, "cases": run_cases(Path(tmp))}, indent=1, sort_keys=True) + "\n"
        )
    print(f"recorded {len(CASES)} cases in {RECORD}")
