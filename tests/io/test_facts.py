"""What the files say of themselves, without a process group: synthetic values, the optimizer,
the storage and fit checks.

Pure tests: each builds what it reads (a state dict, a file), so each fails
when the piece it holds stops doing its one job.
"""

from __future__ import annotations

import pytest
import torch
from testmodels import make_linear

from osdpipe.io.file_facts import detect_format, read_facts
from osdpipe.io.formats.state_facts import moments_alike
from osdpipe.io.loading import PARAM_LAYOUT, LayoutMismatch, check_fits
from osdpipe.layout.optim import torch_optimizers
from osdpipe.layout.optim_infer import infer
from osdpipe.layout.synthetic import grad_key, param_key, values
from osdpipe.spec.reconcile import Contradiction, Given, reconcile, settle_and_validate
from osdpipe.verify.resume_training import shared_memory

# ---------------------------------------------------------------------------
# synthetic values: any range alone, the same bits as the whole
# ---------------------------------------------------------------------------


def test_a_range_of_synthetic_values_is_the_same_range_of_the_whole() -> None:
    whole = values(grad_key(0, 3, "blocks.0.wq.weight"), 0, 1000, 1e-2, torch.float32)
    for start, stop in [(0, 1), (3, 400), (401, 1000), (999, 1000), (7, 7)]:
        assert torch.equal(
            values(grad_key(0, 3, "blocks.0.wq.weight"), start, stop, 1e-2, torch.float32), whole[start:stop]
        )
    assert whole.abs().max() <= 1e-2 and whole.std() > 1e-3, "values spread over [-scale, scale)"
    assert len(set(whole.tolist())) > 990, "distinct elements get distinct values"


@pytest.mark.parametrize("other", [grad_key(1, 3, "w"), grad_key(0, 4, "w"), grad_key(0, 3, "v"), param_key(0, "w")])
def test_synthetic_values_depend_on_every_part_of_the_key(other: str) -> None:
    assert not torch.equal(
        values(grad_key(0, 3, "w"), 0, 64, 1.0, torch.float32), values(other, 0, 64, 1.0, torch.float32)
    )


# ---------------------------------------------------------------------------
# the optimizer, from its state
# ---------------------------------------------------------------------------


def _state_dict(name: str, **options: object) -> dict:
    param = torch.zeros(2, 3, requires_grad=True)
    optim = getattr(torch.optim, name)([param], lr=1e-3, **options)
    param.grad = torch.full_like(param, 0.25)
    optim.step()
    return optim.state_dict()


@pytest.mark.parametrize("name", [n for n in torch_optimizers() if n != "Muon"])
def test_every_torch_optimizer_is_told_from_its_own_state_dict(name: str) -> None:
    sd = _state_dict(name)
    got = infer(sd["param_groups"], {str(k) for s in sd["state"].values() for k in s})
    assert got.name == name, got


def test_adamw_is_told_from_adam_by_its_switch_and_without_param_groups_the_state_decides() -> None:
    for name, options in [
        ("Adam", {"amsgrad": True}),
        ("AdamW", {"weight_decay": 0.1}),
        ("SGD", {"momentum": 0.9, "nesterov": True}),
        ("RMSprop", {"centered": True, "momentum": 0.5}),
    ]:
        sd = _state_dict(name, **options)
        assert infer(sd["param_groups"], {k for s in sd["state"].values() for k in s}).name == name, (name, options)
    nadam = _state_dict("NAdam")["state"][0]
    assert infer(None, set(nadam)).name == "NAdam", "without param groups, the state names decide"
    assert infer(None, {"momentum_buffer"}).candidates == ("Muon", "RMSprop", "SGD"), "and say when they cannot"


# ---------------------------------------------------------------------------
# storage: what the resume check and the output test look for
# ---------------------------------------------------------------------------


def test_shared_memory_names_every_overlap_and_nothing_else() -> None:
    step = torch.tensor(3.0)
    buffer = torch.zeros(10)
    state = {
        0: {"step": step, "exp_avg": buffer[:5]},
        1: {"step": step.clone(), "exp_avg": buffer[5:]},
        2: {"step": step, "exp_avg": torch.zeros(0)},
    }
    assert shared_memory(state, {0: "a", 2: "c"}) == ["step of 0 (a) and step of 2 (c)"]
    state[1]["exp_avg"] = buffer[4:9]  # views that overlap by one element
    assert sorted(shared_memory(state)) == ["exp_avg of 0 and exp_avg of 1", "step of 0 and step of 2"]


def test_moments_alike_only_when_every_parameter_has_equal_moments() -> None:
    a, b = torch.randn(40), torch.randn(40)
    healthy = {"w": {"exp_avg": a, "exp_avg_sq": a * a}, "v": {"exp_avg": b, "exp_avg_sq": b * b}}
    assert not moments_alike(healthy)
    damaged = {"w": {"exp_avg": a * a, "exp_avg_sq": a * a}, "v": {"exp_avg": b * b, "exp_avg_sq": (b * b).clone()}}
    assert moments_alike(damaged)
    tail = (b * b).clone()
    tail[-1] += 1  # equal in the first elements, not in the last
    assert not moments_alike({**damaged, "v": {"exp_avg": b * b, "exp_avg_sq": tail}})


# ---------------------------------------------------------------------------
# loading checks what it loads
# ---------------------------------------------------------------------------


def _optim_over(*shapes: tuple[int, ...]) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(s)) for s in shapes], lr=1e-3)


def test_check_fits_refuses_a_state_of_another_shape_naming_the_id_and_both_shapes() -> None:
    optim = _optim_over((8224,), (6,))
    osd = {
        "state": {0: {"exp_avg": torch.zeros(16384), "step": torch.tensor(1.0)}},
        PARAM_LAYOUT: {
            0: {"key": "_flat_param", "fqns": ["a", "b"], "shapes": [[128, 128], [0]], "local_shape": [16384]}
        },
    }
    with pytest.raises(
        LayoutMismatch,
        match=r"param ID 0 \(_flat_param: a, b\): state 'exp_avg' has shape \(16384,\), "
        r"but the optimizer's parameter 0 has local shape \(8224,\)",
    ):
        check_fits(optim, osd)
    check_fits(_optim_over((16384,), (6,)), osd)  # the same file fits the layout it was made for


def test_check_fits_holds_a_flat_parameter_to_the_parameters_it_is_made_of() -> None:
    optim = _optim_over((20,))
    flat = optim.param_groups[0]["params"][0]
    # what FSDP1's FlatParameter carries
    flat._fqns, flat._shapes = ("gate", "lin.weight"), (torch.Size([2, 5]), torch.Size([10]))
    record = {
        "key": "block1._flat_param",
        "fqns": ["block1.gate", "block1.lin.weight"],
        "shapes": [[2, 5], [10]],
        "local_shape": [20],
    }
    check_fits(optim, {"state": {0: {"exp_avg": torch.zeros(20)}}, PARAM_LAYOUT: {0: record}})
    # the same size, made otherwise
    other = {**record, "fqns": ["block1.lin.weight", "block1.gate"], "shapes": [[10], [2, 5]]}
    with pytest.raises(LayoutMismatch, match=r"is an FSDP unit's flat parameter of gate, lin.weight"):
        check_fits(optim, {"state": {0: {"exp_avg": torch.zeros(20)}}, PARAM_LAYOUT: {0: other}})


def test_check_fits_with_a_model_holds_each_id_to_the_parameter_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    records = {
        i: {"key": f"{i}.weight", "fqns": [f"{i}.weight"], "shapes": [[3, 3]], "local_shape": [3, 3]} for i in range(2)
    }
    state = {i: {"exp_avg": torch.zeros(3, 3)} for i in range(2)}
    check_fits(optim, {"state": state, PARAM_LAYOUT: records}, model=model)
    swapped = {0: records[1], 1: records[0]}  # same shapes, other parameters: only names tell
    with pytest.raises(
        LayoutMismatch, match=r"param ID 0 holds 1.weight .* but the optimizer's parameter 0 is the model's 0.weight"
    ):
        check_fits(optim, {"state": state, PARAM_LAYOUT: swapped}, model=model)


# ---------------------------------------------------------------------------
# believe the files: formats, facts, and a user's description against them
# ---------------------------------------------------------------------------


@pytest.fixture
def adamw_file(tmp_path):
    """A full FQN-keyed AdamW state, as an unwrapped job's keyed by name."""
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    names = [n for n, _ in model.named_parameters()]
    sd = optim.state_dict()
    full = {
        "state": {names[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": names} for g in sd["param_groups"]],
    }
    torch.save(full, tmp_path / "optim.pt")
    torch.save(sd, tmp_path / "plain.pt")
    return tmp_path


def test_formats_are_read_from_the_files(adamw_file) -> None:
    assert detect_format(adamw_file / "optim.pt") == "fsdp_full"
    assert detect_format(adamw_file / "plain.pt") == "plain"
    facts = read_facts(adamw_file / "optim.pt")
    assert (facts.optimizer, facts.params, facts.steps, facts.world_size) == ("AdamW", 2, [1.0, 1.0], None)
    assert facts.param_groups[0]["weight_decay"] == 0.05 and facts.param_groups[0]["params"] == 2
    assert facts.state_bytes == 2 * (12 + 3) * 4


def _raw(path, **overrides):
    raw = {
        "model": {"factory": "nested"},
        "input": {"path": str(path), "format": "fsdp_full", "key": "optim"},
        "source": {"kind": "fsdp1", "world_size": 2},
        "optim": {"name": "auto", "lr": None, "kwargs": {}, "param_groups": []},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        raw[section][name] = value
    return raw


def test_reconcile_fills_what_was_not_given_and_refuses_what_contradicts(adamw_file) -> None:
    raw, warnings = reconcile(_raw(adamw_file / "plain.pt"), Given([]))
    assert (
        raw["input"]["format"],
        raw["source"]["kind"],
        raw["source"]["world_size"],
        raw["optim"]["name"],
        raw["optim"]["lr"],
    ) == ("plain", "none", 1, "AdamW", None)
    assert warnings == []
    with pytest.raises(
        Contradiction,
        match=r"input.format=fsdp_full, but .*plain.pt is a torch.save file keyed by param ID: set input.format=plain",
    ):
        reconcile(_raw(adamw_file / "plain.pt"), Given(["input.format=fsdp_full"]))
    with pytest.raises(
        Contradiction,
        match=r"optim.name=SGD reads hyperparameters \['dampening', 'momentum', 'nesterov'\], "
        r"which the checkpoint's param groups .* set optim.name=AdamW",
    ):
        reconcile(_raw(adamw_file / "optim.pt", optim__name="SGD"), Given(["optim.name=SGD"]))
    _, warnings = reconcile(
        _raw(adamw_file / "optim.pt", optim__name="AdamW", optim__lr=0.1), Given(["optim.name=AdamW", "optim.lr=0.1"])
    )
    assert warnings == [
        "optim.lr=0.1 differs from the checkpoint's lr=0.0003 in param group 0; "
        "the output keeps the checkpoint's 0.0003, "
        "which a resuming optimizer's load_state_dict sets (change it after loading to train with another)"
    ]


@pytest.mark.parametrize(
    ("given", "kind", "warned"),
    [
        ({}, "fsdp1", "optim.pt's files do not say which kind of job saved it"),  # one step per parameter: no kind
        ({"source.kind": "fsdp2"}, "fsdp2", None),  # the kind the user gives
        ({"source.kind": "ddp"}, "ddp", None),
        ({"source.kind": "none"}, "fsdp1", "(source.kind=none), not a layout of ranks to follow"),
        ({"target.kind": "fsdp2"}, "fsdp2", None),  # given: kept
    ],
)
def test_the_targets_kind_unset_follows_the_sources(
    adamw_file, given: dict[str, str], kind: str, warned: str | None
) -> None:
    """``target.kind`` null (the command's default) is the source's kind: where the files do not tell it, or the source
    is one process's, a warning names the kind chosen. A ``target`` without ``kind`` (a config built in code) keeps
    the schema's default, unsaid."""
    raw = {**_raw(adamw_file / "optim.pt"), "target": {"kind": None, "world_size": 2}}
    for key, value in given.items():
        raw[key.split(".")[0]][key.split(".")[1]] = value
    settled, warnings = reconcile(raw, Given([f"{k}={v}" for k, v in given.items()]))
    assert settled["target"]["kind"] == kind
    said = [w for w in warnings if w.startswith("target.kind=")]
    assert len(said) == (warned is not None) and all(warned in w for w in said), warnings
    unset, warnings = reconcile({**_raw(adamw_file / "optim.pt"), "target": {"world_size": 2}}, Given([]))
    assert "kind" not in unset["target"] and warnings == []


def test_a_config_built_in_code_gets_the_inputs_optimizer(adamw_file) -> None:
    spec = settle_and_validate(
        {
            "model": {"factory": "testmodels:make_linear"},
            "input": {"path": str(adamw_file / "optim.pt")},
            "output": {"path": str(adamw_file / "out")},
        }
    )
    # the checkpoint's groups keep their lr: a fact, not a setting
    assert (spec.optim.name, spec.optim.lr) == ("AdamW", None)
    generated = settle_and_validate({"output": {"path": str(adamw_file / "gen")}})
    assert (generated.optim.name, generated.optim.lr) == ("Adam", 1e-2)


def test_a_checkpoint_at_the_end_of_its_schedule_converts_with_its_own_hyperparameters(tmp_path) -> None:
    """A linear decay to 0 leaves lr=0.0 in the param groups (torchtitan's last step, the Trainer's final checkpoint):
    a fact of the file, not a setting, so it converts, and the output keeps it with weight_decay=0 and the betas as
    saved."""
    import sys

    from helpers import run_command, user_env

    model = make_linear()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LinearLR(optim, start_factor=1.0, end_factor=0.0, total_iters=2)
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        optim.step()
        schedule.step()
    assert optim.param_groups[0]["lr"] == 0.0
    torch.save(optim.state_dict(), tmp_path / "plain.pt")
    out = tmp_path / "out"
    done = run_command(
        [sys.executable, "-m", "osdpipe", f"input.path={tmp_path / 'plain.pt'}", "model.factory=testmodels:make_linear",
         "target.kind=fsdp2", "target.world_size=2", "runtime.mode=offline", f"output.path={out}"],
        cwd=tmp_path, timeout=120, env=user_env(),
    )
    assert done.returncode == 0, done.stderr
    group = torch.load(out / "rank_1.pt", weights_only=True)["param_groups"][0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.0, (0.8, 0.95), 0.0)
