"""A DeepSpeed save's optimizer files are named in errors as that save names them (bf16 saves put ``bf16_`` first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.deepspeed import optimizer_files


@pytest.mark.parametrize("prefix", ["", "bf16_"])
def test_a_missing_rank_file_is_named_as_the_save_names_its_files(tmp_path: Path, prefix: str) -> None:
    for rank in (0, 2):
        (tmp_path / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(InputError) as raised:
        optimizer_files(tmp_path)
    message = str(raised.value)
    assert "rank(s) [1]" in message and f"({prefix}zero_pp_rank_<r>_mp_rank_00_optim_states.pt)" in message, message
    if not prefix:
        assert "bf16_" not in message
