"""``runtime.transfer`` and ``runtime.memory_budget``: the same bytes however they travel, and only the bytes needed.

Through the ``osdpipe`` command, on a user's model (``userlm``) read from
``fsdp_full``, ``dcp`` and ``rank_local`` inputs: the default conversion, one
where rank 0 reads and sends every other rank its ranges
(``runtime.transfer=scatter``), ones under a memory budget small enough to cut
every tensor into many batches, and offline under the budget, all write
byte-identical files. With ``scatter`` the bytes sent through the process
group are exactly what the receiving ranks' files hold, counted here from
the files. A reading rank that fails mid-send ends the run on every rank at
once, and ``verify`` catches one wrong element that a receiver holds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers import run_cli_cases, user_env
from oracle_probe import spawn_world

from osdpipe.layout.ranges import Segment, batches
from osdpipe.run.transfer import reading_ranks

TIMEOUT_S = 120

# ---------------------------------------------------------------- pure parts


def test_batches_cut_and_pack_segments_in_dest_order_within_the_limit() -> None:
    segs = [Segment("b", 0, 5, 7), Segment("a", 10, 4, 0), Segment("c", 3, 0, 12)]
    assert batches(segs, None) == [(Segment("a", 10, 4, 0), Segment("b", 0, 5, 7))]  # empty dropped, dest order
    got = batches(segs, 3)
    assert got == [
        (Segment("a", 10, 3, 0),),
        (Segment("a", 13, 1, 3), Segment("b", 0, 2, 7)),
        (Segment("b", 2, 3, 9),),
    ]
    assert all(sum(s.length for s in b) <= 3 for b in got)
    assert batches([], 3) == [] and batches([], None) == []
    with pytest.raises(ValueError):
        batches(segs, 0)


def test_reading_ranks_one_reader_per_host_and_every_rank_served() -> None:
    assert reading_ranks(["h"] * 3, [True] * 3, "shared", "/x") == [0, 1, 2]
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] cannot see /x.*runtime.transfer=scatter"):
        reading_ranks(["h"] * 3, [True, False, True], "shared", "/x")
    assert reading_ranks(["h"] * 4, [True] * 4, "scatter", "/x") == [0, 0, 0, 0]
    assert reading_ranks(["h"] * 3, [False, True, True], "scatter", "/x") == [1, 1, 1]  # the first rank that sees it
    # host a sees the input on rank 1, host c on rank 4; host b has no reader: its ranks are spread over both
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert reading_ranks(hosts, [False, True, False, False, True, False], "scatter", "/x") == [1, 1, 1, 4, 4, 4]
    with pytest.raises(ValueError, match="no rank can see /x"):
        reading_ranks(["h"] * 2, [False, False], "scatter", "/x")


# ---------------------------------------------------------------- through the command


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, list[str]]:
    """The user's job as three inputs: its FQN-keyed full state, and osdpipe's own dcp
    (FSDP2, 3 ranks) and rank_local (FSDP1, 4 ranks) of it."""
    import userlm

    root = tmp_path_factory.mktemp("transfer_inputs")
    torch.manual_seed(0)
    model = userlm.build()
    torch.save(userlm.fqn_keyed(model, userlm.train(model, steps=2)), root / "optim.pt")
    full = [
        "model.factory=userlm:build", f"input.path={root / 'optim.pt'}", "input.format=fsdp_full", "source.world_size=1"
    ]
    made = {
        "dcp": ["target.kind=fsdp2", "target.world_size=3", "target.wrap=[MixerBlock]", "output.format=dcp"],
        "rank_local": ["target.world_size=4", "target.wrap=[MixerBlock]", "target.use_orig_params=true"],
    }
    results = run_cli_cases(
        [[*full, *args, f"output.path={root / name}", "runtime.mode=offline"] for name, args in made.items()],
        cwd=root,
        per_case_s=TIMEOUT_S,
        env=user_env(),
    )
    for result in results:
        assert result["code"] == 0, result["stderr"]
    return {
        "fsdp_full": full,
        "dcp": [
            "model.factory=userlm:build", f"input.path={root / 'dcp' / 'dcp'}", "input.format=dcp",
            "source.kind=fsdp2", "source.world_size=3",
        ],
        "rank_local": [
            "model.factory=userlm:build", f"input.path={root / 'rank_local'}", "input.format=rank_local",
            "source.world_size=4", "source.wrap=[MixerBlock]", "source.use_orig_params=true",
        ],
    }  # fmt: skip


#: The target of each input: FSDP2 and use_orig_params shards hold no padding,
#: so a rank's file holds exactly the bytes it needs.
TARGETS = {
    "fsdp_full": ["target.kind=fsdp2", "target.world_size=3", "target.wrap=[MixerBlock]"],
    "dcp": ["target.kind=fsdp1", "target.world_size=2", "target.wrap=[MixerBlock]", "target.use_orig_params=true"],
    "rank_local": ["target.kind=fsdp2", "target.world_size=3", "target.wrap=[MixerBlock]"],
}
VARIANTS = {
    "default": [],
    "scatter": ["runtime.transfer=scatter"],
    "budget": ["runtime.memory_budget=1KB"],  # 125 float32 elements per batch: every tensor of the model is cut
    "scatter_budget": ["runtime.transfer=scatter", "runtime.memory_budget=1KB"],
    "offline_budget": ["runtime.mode=offline", "runtime.memory_budget=1KB"],
}


def _tensor_bytes(path: Path) -> int:
    osd = torch.load(path, weights_only=True)
    return sum(
        v.numel() * v.element_size()
        for s in osd["state"].values()
        if isinstance(s, dict)
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )


def test_every_transfer_and_budget_writes_the_same_bytes_and_scatter_sends_only_what_receivers_need(
    inputs, tmp_path: Path
) -> None:
    cases, where = [], []
    for source, args in inputs.items():
        for variant, extra in VARIANTS.items():
            out = tmp_path / source / variant
            cases.append([*args, *TARGETS[source], f"output.path={out}", "runtime.timeout_s=60", *extra])
            where.append((source, variant, out))
    results = run_cli_cases(cases, cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env())
    for (source, variant, _), result in zip(where, results, strict=True):
        assert result["code"] == 0, f"{source} {variant}: {result['stderr']}"
    for source in inputs:
        reference = tmp_path / source / "default"
        files = sorted(p.name for p in reference.glob("rank_*.pt"))
        assert len(files) in (2, 3), files
        for variant in VARIANTS:
            out = tmp_path / source / variant
            for name in files:
                assert (out / name).read_bytes() == (reference / name).read_bytes(), (
                    f"{source}: {variant} {name} differs from the default's"
                )
            report = json.loads((out / "report.json").read_text())
            assert report["ok"], report
            shard = next(s for s in report["stages"] if s["name"] == "shard")
            # rank 0 reads for the others
            needed = sum(_tensor_bytes(out / name) for name in files if name != "rank_0.pt")
            assert shard["sent"] == (needed if "scatter" in variant else 0), (
                f"{source} {variant}: sent {shard['sent']}, receivers need {needed}"
            )
            assert report["memory_budget"] == (1000 if "budget" in variant else None)
            assert report["output_bytes"] == [_tensor_bytes(out / name) for name in files]
            if "scatter" in variant:
                assert {c["name"] for c in report["checks"]} == {"roundtrip", "resume"}, report["checks"]
                resume = next(c for c in report["checks"] if c["name"] == "resume")
                assert (
                    "steps not run: they need the source on every rank, which runtime.transfer=scatter"
                    in resume["detail"]
                ), resume
                assert {c["name"] for c in report["skipped_checks"]} >= {"reference", "load_step"}


def test_scatter_needs_a_world(inputs, tmp_path: Path) -> None:
    result = run_cli_cases(
        [[*inputs["fsdp_full"], *TARGETS["fsdp_full"], f"output.path={tmp_path / 'out'}",
          "runtime.mode=offline", "runtime.transfer=scatter"],
         [*inputs["fsdp_full"], *TARGETS["fsdp_full"], f"output.path={tmp_path / 'out2'}", "runtime.memory_budget=12"]],
        cwd=tmp_path, per_case_s=TIMEOUT_S, env=user_env(),
    )  # fmt: skip
    assert (
        result[0]["code"] == 2
        and "runtime.transfer=scatter sends bytes between the ranks of a world" in result[0]["stderr"]
    ), result[0]
    assert (
        result[1]["code"] == 2
        and "runtime.memory_budget (got 12): a memory budget of 12B leaves no room to copy" in result[1]["stderr"]
    ), result[1]


# ---------------------------------------------------------------- failures while bytes travel


def _reader_fails_while_serving(spec, source: str) -> tuple[str, float]:
    """On rank 0, reading fails on the 3rd range; every rank must raise the same error at once
    (none waits for bytes)."""
    import torch.distributed as dist
    from helpers import planned

    from osdpipe.io.formats.fsdp_full import FullReader
    from osdpipe.pipeline.loop import run_stages
    from osdpipe.run.collective import StageError
    from osdpipe.run.world import GroupWorld

    if dist.get_rank() == 0:
        calls = {"n": 0}
        real = FullReader.read_range

        def failing(self, *args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError("the disk went away")
            return real(self, *args)

        FullReader.read_range = failing
    start = time.monotonic()
    try:
        run_stages(planned(spec, source, "fsdp_full"), GroupWorld())
    except StageError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_reading_rank_that_fails_mid_send_ends_the_run_on_every_rank(inputs, tmp_path: Path) -> None:
    from osdpipe.spec.reconcile import settle_and_validate

    source = inputs["fsdp_full"][1].split("=", 1)[1]
    spec = settle_and_validate({
        "model": {"factory": "userlm:build"}, "source": {"world_size": 1},
        "target": {"world_size": 3, "wrap": ["MixerBlock"]}, "output": {"path": str(tmp_path / "out")},
        "runtime": {"transfer": "scatter", "timeout_s": 60, "progress": False},
    })  # fmt: skip
    results = spawn_world(_reader_fails_while_serving, 3, (spec, source), timeout_s=TIMEOUT_S)
    for rank, (error, seconds) in enumerate(results):
        assert error == "stage 'shard' failed on rank 0: the disk went away", f"rank {rank}: {error}"
        assert seconds < 30, f"rank {rank} took {seconds:.1f} s: it waited for bytes that never came"
