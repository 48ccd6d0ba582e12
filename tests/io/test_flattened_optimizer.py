"""A flattened optimizer state dict (``flatten_optimizer_state_dict=True``, torchtitan's) reads as the nested one
(osdpipe.io.formats.dcp_reader)."""

from __future__ import annotations

from osdpipe.io.formats.dcp_reader import nested_paths, unflatten_optimizer


def test_flattened_paths_become_nested_ones_fqn_dots_and_all() -> None:
    planner = {
        "optimizer.state.layers.0.attention.wq.weight.exp_avg": (
            "optimizer", "state.layers.0.attention.wq.weight.exp_avg"
        ),
        "optimizer.param_groups.layers.0.attention.wq.weight.lr": (
            "optimizer", "param_groups.layers.0.attention.wq.weight.lr"
        ),
        "optim.state.a.step": ("optim", "state", "a", "step"),
        "tok_embeddings.weight": ("tok_embeddings.weight",),
        "lr_scheduler.last_epoch": ("lr_scheduler", "last_epoch"),
    }
    paths = nested_paths(planner)
    assert paths["optimizer.state.layers.0.attention.wq.weight.exp_avg"] == (
        "optimizer", "state", "layers.0.attention.wq.weight", "exp_avg"
    )
    assert paths["optimizer.param_groups.layers.0.attention.wq.weight.lr"] == (
        "optimizer", "param_groups", "layers.0.attention.wq.weight", "lr"
    )
    for untouched in ("optim.state.a.step", "tok_embeddings.weight", "lr_scheduler.last_epoch"):
        assert paths[untouched] == planner[untouched]
    assert all(".".join(map(str, p)) == flat for flat, p in paths.items())  # the flat key is the dotted path either way


def test_groups_come_back_from_each_parameters_hyperparameters() -> None:
    flat = {
        "state.a.b.exp_avg": 1, "state.a.b.step": 2, "state.c.exp_avg": 3,
        "param_groups.a.b.lr": 0.1, "param_groups.a.b.eps": 1e-8,
        "param_groups.c.lr": 0.1, "param_groups.c.eps": 1e-8,
        "param_groups.d.lr": 0.5, "param_groups.d.eps": 1e-8,
        "param_groups.e.lr": 0.1, "param_groups.e.eps": 1e-8,
    }
    nested = unflatten_optimizer(flat)
    assert nested["state"] == {"a.b": {"exp_avg": 1, "step": 2}, "c": {"exp_avg": 3}}
    assert nested["param_groups"] == [
        {"lr": 0.1, "eps": 1e-8, "params": ["a.b", "c"]},
        {"lr": 0.5, "eps": 1e-8, "params": ["d"]},
        {"lr": 0.1, "eps": 1e-8, "params": ["e"]},  # a group apart from the first: not next to it
    ]
