"""``gs://`` in and out against a Google Cloud Storage server on 127.0.0.1 (gcp-storage-emulator, see
tests/cloud/conftest.py), through gcsfs as a user's job reaches GCS: a DCP checkpoint and an ``fsdp_full`` file read
by range from a bucket, a conversion committed into a bucket, ``osdpipe inspect`` and ``osdpipe check`` of URLs; each
byte for byte the local conversion's.

gcsfs finds the server through ``STORAGE_EMULATOR_HOST`` (and then needs no credentials), as it finds any emulator.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from cloudenv import AWS_CHAIN
from helpers import run_cli_cases, user_env

TIMEOUT_S = 180
RECORDS = ("manifest.json", "report.json", "osdpipe.log")
MODEL = ["model.factory=userlm:build"]
#: A 4-rank FSDP2 DCP checkpoint converted to 2 ranks, offline.
FROM_DCP = ["source.kind=fsdp2", "source.world_size=4", "target.kind=fsdp2", "target.world_size=2",
            "runtime.mode=offline"]  # fmt: skip
FROM_FILE = ["source.world_size=1", "target.kind=fsdp2", "target.world_size=3", "runtime.mode=offline"]


def _gcs(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path):
    """The environment pointing gcsfs at the server, no credential of the machine's in reach; a gcsfs filesystem."""
    import gcsfs

    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CONFIG", *AWS_CHAIN):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(home / "gcloud-absent"))
    return gcsfs.GCSFileSystem(skip_instance_cache=True)


@pytest.fixture(scope="module")
def converted(gcs_endpoint: str, tmp_path_factory) -> tuple[str, Path, dict[str, dict], object]:
    """The user's job as a DCP checkpoint of 4 ranks and as an ``fsdp_full`` file, on the local disk and under
    ``gs://<bucket>/src/``; converted from each side into each side, and the commands on URLs run."""
    import torch
    import userlm

    root = tmp_path_factory.mktemp("gs")
    with pytest.MonkeyPatch.context() as monkeypatch:
        fs = _gcs(monkeypatch, gcs_endpoint, root)
        bucket = f"osdpipe-{uuid.uuid4().hex[:16]}"
        fs.mkdir(bucket)
        torch.manual_seed(0)
        model = userlm.build()
        torch.save(userlm.fqn_keyed(model, userlm.train(model, steps=2)), root / "optim.pt")
        made = [*MODEL, f"input.path={root / 'optim.pt'}", "source.world_size=1", "runtime.mode=offline",
                "target.kind=fsdp2", "target.world_size=4", "output.format=dcp",
                f"output.path={root / 'src'}"]  # fmt: skip
        [first] = run_cli_cases([made], cwd=root, per_case_s=TIMEOUT_S, env=user_env())
        assert first["code"] == 0, first["stderr"]
        fs.put(f"{root / 'src' / 'dcp'}/", f"{bucket}/src/dcp/", recursive=True)
        fs.put(str(root / "optim.pt"), f"{bucket}/src/optim.pt")
        url = f"gs://{bucket}"
        cases = {
            "local": [*MODEL, f"input.path={root / 'src' / 'dcp'}", *FROM_DCP, f"output.path={root / 'local'}"],
            "gs_in": [*MODEL, f"input.path={url}/src/dcp", *FROM_DCP, f"output.path={root / 'gs_in'}"],
            "gs_out": [*MODEL, f"input.path={root / 'src' / 'dcp'}", *FROM_DCP, f"output.path={url}/out"],
            "file_local": [*MODEL, f"input.path={root / 'optim.pt'}", *FROM_FILE, f"output.path={root / 'file_local'}"],
            "file_gs": [*MODEL, f"input.path={url}/src/optim.pt", *FROM_FILE, f"output.path={root / 'file_gs'}"],
            "check": ["check", f"{url}/out"],
            "inspect": ["inspect", f"{url}/src/dcp"],
        }
        results = run_cli_cases(list(cases.values()), cwd=root, per_case_s=TIMEOUT_S, env=user_env())
        fs.get(f"{bucket}/out/", str(root / "gs_out") + "/", recursive=True)
    return url, root, dict(zip(cases, results, strict=True)), fs


def _data(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*")
            if p.is_file() and p.name not in RECORDS}  # fmt: skip


@pytest.mark.parametrize(("case", "reference"), [("gs_in", "local"), ("gs_out", "local"), ("file_gs", "file_local")])
def test_a_conversion_from_or_into_gs_is_byte_for_byte_the_local_one(converted, case: str, reference: str) -> None:
    url, root, results, _ = converted
    for name in (case, reference):
        assert results[name]["code"] == 0, results[name]["stderr"]
    assert _data(root / reference) and _data(root / case) == _data(root / reference)
    manifests = [json.loads((root / d / "manifest.json").read_text()) for d in (reference, case)]
    assert manifests[1]["content_sha256"] == manifests[0]["content_sha256"]
    if case == "gs_out":
        assert manifests[1]["config"]["output"]["path"] == f"{url}/out"


def test_check_and_inspect_take_a_gs_url(converted) -> None:
    url, _, results, _ = converted
    assert results["check"]["code"] == 0, results["check"]["stderr"]
    assert f"osdpipe check: OK  {url}/out" in results["check"]["stdout"]
    assert results["inspect"]["code"] == 0, results["inspect"]["stderr"]
    assert "convert with osdpipe" in results["inspect"]["stdout"]


def test_the_google_clients_chatter_is_not_printed(converted) -> None:
    """google-auth warns, on every run, of each way to credentials that failed before one worked."""
    _, _, results, _ = converted
    said = "".join(r["stdout"] + r["stderr"] for r in results.values())
    assert "Authentication failed" not in said and "[HYDRA]" not in said, said[:2000]


def test_under_a_memory_budget_a_file_goes_up_to_gs_in_chunks(gcs_endpoint: str, monkeypatch, tmp_path: Path) -> None:
    """gcsfs takes the budget's part size as its resumable upload's chunks (multiples of 256 KiB): a 12 MiB file
    arrives whole, counted a 5 MiB chunk at a time (gcsfs says how far a file is, where s3fs says each part's bytes:
    before, the progress line counted no byte of a gs upload)."""
    import torch

    from osdpipe.io import remote_output

    fs = _gcs(monkeypatch, gcs_endpoint, tmp_path)
    bucket = f"osdpipe-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    directory = tmp_path / "conversion"
    directory.mkdir()
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    (directory / "rank_0.pt").write_bytes(data)
    (directory / "manifest.json").write_text(json.dumps({"files": {"rank_0.pt": "x"}, "config": {}}))
    destination = remote_output.prepare(f"gs://{bucket}/out", overwrite=False, memory_budget=40 << 20)
    shown: list[tuple[int, int]] = []
    remote_output.publish(destination, directory, lambda done, total: shown.append((done, total)))
    steps = [b - a for (a, _), (b, _) in zip([(0, 0), *shown], shown)]
    assert fs.cat_file(f"{bucket}/out/rank_0.pt") == data
    assert max(steps) <= 5 << 20 and sum(steps) >= 12 << 20, steps


def test_a_rank_file_goes_up_to_gs_as_it_is_written_and_is_whole_once_handed_over(
    gcs_endpoint: str, monkeypatch, tmp_path: Path
) -> None:
    """A followed rank file (osdpipe.io.followed_upload) through gcsfs's resumable upload: whole chunks while it is
    written, its last one (not a multiple of 256 KiB, which GCS takes only as the final chunk) when it is handed
    over; nothing at its key before."""
    import torch

    from osdpipe.io import followed_upload, remote_output, torchfile
    from osdpipe.io.upload_queue import UploadQueue

    fs = _gcs(monkeypatch, gcs_endpoint, tmp_path)
    bucket = f"osdpipe-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    destination = remote_output.prepare(f"gs://{bucket}/out", overwrite=False, memory_budget=40 << 20)
    assert followed_upload.PARTS.get("gs") is None  # fsspec's buffered file
    queue, staging = UploadQueue(destination.upload), tmp_path / "staging"
    staging.mkdir()
    data = torch.randint(0, 256, ((40 << 20) + 12345,), dtype=torch.uint8).numpy().tobytes()
    with queue.following(staging), torchfile.written(staging / "rank_0.pt", sync=False) as out:
        out.write(data)
    upload = queue.followed("rank_0.pt")
    assert upload is not None and upload.settled(60) == "held"
    assert not fs.exists(f"{bucket}/out/rank_0.pt")
    queue.send(staging, ["rank_0.pt"])
    assert queue.finish() is None and upload.state == "whole"
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/out/rank_0.pt") == data
