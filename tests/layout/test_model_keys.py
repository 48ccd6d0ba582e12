"""A model's state-dict keys come from the model: keys its hooks make of its parameters' rows (issue 30).

torchtitan's llama3 fuses ``wq``/``wk``/``wv`` into one ``wqkv`` parameter and
its hooks save it as the three; the optimizer stays keyed by ``wqkv``. The
tests' own :mod:`fusedlm` does the same with an interleaved ``up_gate`` and a
renamed, tied embedding. osdpipe learns each key from ``state_dict()`` on
probes (:mod:`osdpipe.layout.model_keys`), and converts each side by its own map.
"""

from __future__ import annotations

import sys

import pytest
import torch
from fusedlm import build
from helpers import run_command, user_env
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from osdpipe.layout.model_keys import KeyMapError, gather
from osdpipe.layout.tree import describe


def _meta(make):
    with torch.device("meta"):
        return make()


@pytest.mark.parametrize("kwargs", [{}, {"hidden": 8, "group": 4, "dim": 5}, {"hidden": 6, "group": 1, "blocks": 1}])
def test_every_hook_made_key_is_the_rows_the_model_itself_saves(kwargs) -> None:
    tree = describe(_meta(lambda: build(**kwargs)))
    model = build(**kwargs)
    saved = model.state_dict()
    assert set(tree.state_names) == set(saved)
    assert {k.name for k in tree.key_maps} == (
        {n for n in saved if ".mlp.up" in n or ".mlp.gate" in n} | {"tok_embeddings.weight"}
    )
    params = {p.fqn: model.get_parameter(p.fqn).detach() for p in tree.params}
    for key in tree.key_maps:
        assert torch.equal(gather(key, params), saved[key.name]), key.name
    # a hook's key is never taken for a buffer
    assert not [b for b in tree.buffers if b.fqn in {k.name for k in tree.key_maps}]


def test_a_model_without_such_hooks_is_not_probed() -> None:
    assert describe(_meta(lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)))).key_maps == ()


class _Scaled(nn.Module):
    """Saves its weight times two: not rows of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 3))
        self.register_state_dict_post_hook(
            lambda m, sd, prefix, meta: sd.__setitem__(f"{prefix}w2", sd.pop(f"{prefix}weight") * 2)
        )


class _Transposed(nn.Module):
    """Saves its weight transposed: elements move within rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 3))
        self.register_state_dict_post_hook(
            lambda m, sd, prefix, meta: sd.__setitem__(f"{prefix}wt", sd.pop(f"{prefix}weight").t().contiguous())
        )


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (_Scaled, "holds values that are no parameter's rows"),
        (_Transposed, "mixes elements of different rows within one row"),
    ],
)
def test_a_key_that_is_not_rows_of_parameters_is_refused_in_one_line(make, said) -> None:
    with pytest.raises(
        KeyMapError, match=f"state-dict key .* {said}.*; osdpipe converts a key only as whole rows of parameters"
    ):
        describe(_meta(make))


def _whole(directory):
    """A DCP directory's whole content, as PyTorch's own converter writes it to one file."""
    out = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_the_users_hooked_model_converts_and_loads_back_through_its_own_hooks(tmp_path) -> None:
    """FSDP2 on 2 ranks -> 3, laid out as torchtitan saves: the command's own checks pass, and, read back by PyTorch's
    own converter, every entry equals the source's; the model's own load_state_dict takes the output's keys."""
    out = tmp_path / "out"
    done = run_command(
        [
            sys.executable, "-m", "osdpipe",
            "checkpoint=torchtitan", "model.factory=fusedlm:build",
            "source.kind=fsdp2", "source.world_size=2", "target.kind=fsdp2", "target.world_size=3",
            "output.format=dcp", "output.model_format=safetensors", f"output.path={out}",
        ],
        cwd=tmp_path, timeout=300, env=user_env(),
    )
    assert done.returncode == 0, done.stderr
    source, converted = _whole(next((out / "source").iterdir())), _whole(out / "step-3")
    assert set(converted) == set(source)
    for name, value in source.items():
        if torch.is_tensor(value):
            assert torch.equal(converted[name], value), name
    for name in ("blocks.0.mlp.up", "blocks.1.mlp.gate", "tok_embeddings.weight"):
        assert name in converted and "optimizer" in converted
    # the optimizer stays keyed by the parameter
    assert any(k.startswith("state.blocks.0.mlp.up_gate.") for k in converted["optimizer"])
    model = build()
    model.load_state_dict({k: converted[k] for k in model.state_dict()})
    assert all(torch.equal(model.state_dict()[k], converted[k]) for k in model.state_dict())
    from safetensors.torch import load_file

    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(model.state_dict()) - {"head.weight"}  # a tied weight once, under its first name
    assert all(torch.equal(exported[k], converted[k]) for k in exported)
