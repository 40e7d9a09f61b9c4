"""Changes a user makes to a model after wrapping it: parameters assigned anew, modules swapped,
weights written through ``.data``, or edited inside ``gathered()`` on every rank or on one
(``modifier_rank``).

A change the flat shards can follow takes effect exactly as on the plain model (checked against
a deep-copied plain model given the same change, over SGD steps at 2 ranks); one they cannot
follow is refused at the line that makes it, naming the fix, with nothing changed.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_changes_after_wrapping.py -q``
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import Offload, ShardedModule
from tests.support.models import tiny_gpt2_config
from tests.support.ranks import run_ranks

WORLD = 2
STAGES = [1, 2, 3]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.a(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.b2(self.b1(x)))


@functools.cache
def _net() -> Net:
    """The model every test starts from; each rank wraps a copy (ranks as threads share
    torch's random generator, so none draws its own)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Net()


def _batches() -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4 * WORLD, 8, generator=g) for _ in range(3)]


def _train(m: nn.Module, rank: int, world: int) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for x in _batches():
        m(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _wrap(pg: ProcessGroup, stage: int = 3) -> ShardedModule:
    return ShardedModule(copy.deepcopy(_net()), process_group=pg, auto_wrap=Block, stage=stage)


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_assigned_anew_is_the_one_forward_uses(stage: int) -> None:
    """``model.b1.a.weight = nn.Parameter(w)`` of the same shape: forward computes with ``w``
    (before, it kept the old shard while ``full_state_dict()`` showed ``w``), it trains as the
    plain model's does, and a ``requires_grad=False`` one stays frozen."""
    new = torch.full((8, 8), 0.05)
    plain = copy.deepcopy(_net())
    plain.b1.a.weight = nn.Parameter(new.clone())
    plain.head.bias = nn.Parameter(torch.ones(3), requires_grad=False)
    first = plain(_batches()[0])
    _train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> tuple[Tensor, dict[str, Tensor]]:
        m = _wrap(pg, stage)
        m.b1.a.weight = nn.Parameter(new.clone())
        m.head.bias = nn.Parameter(torch.ones(3), requires_grad=False)
        out = m(_batches()[0]).detach()
        _train(m, rank, WORLD)
        return out, m.full_state_dict()

    for out, state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(out, first.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)
    assert torch.equal(plain.head.bias, torch.ones(3))


@pytest.mark.parametrize(
    "change, expected",
    [
        ("resize", "a resize or a cast"),
        ("cast", "a resize or a cast"),
        ("new name", "adds a parameter"),
        ("parameter in an empty container added", "extra.scale = nn.Parameter.*adds a parameter"),
        ("layer in an empty container added", "swaps a module holding parameters"),
        ("tie", "ties the two"),
        ("module with parameters", "swaps a module holding parameters"),
    ],
)
def test_a_change_the_shards_cannot_follow_is_refused_at_its_line(
    change: str, expected: str
) -> None:
    """Each is refused where it is made, naming the fix, and the model trains on unchanged. A
    container that held nothing when it was added (an empty ``nn.ParameterDict`` or
    ``nn.Sequential``) had been taken and its modules left unwatched: filled afterwards, it
    trained whole and unaveraged on each rank, the ranks drifting apart."""

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(pg)
        before = m.full_state_dict()
        error = TypeError if "swaps" in expected else ValueError
        with pytest.raises(error, match=expected):
            if change == "resize":
                m.b1.a.weight = nn.Parameter(torch.zeros(9, 8))
            elif change == "cast":
                m.b1.a.weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.float64))
            elif change == "new name":
                m.b1.scale = nn.Parameter(torch.ones(8))
            elif change == "parameter in an empty container added":
                m.extra = nn.ParameterDict()  # holds none: taken, then filled
                m.extra["scale"] = nn.Parameter(torch.ones(3))
            elif change == "layer in an empty container added":
                m.b1.more = nn.Sequential()
                m.b1.more.append(nn.Linear(8, 8))
            elif change == "tie":
                m.b2.a.weight = m.b1.a.weight
            else:
                m.b1.a = nn.Linear(8, 8)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        _train(m, rank, WORLD)

    run_ranks(WORLD, fn, timeout=30)


def test_a_module_without_parameters_may_be_swapped() -> None:
    """Swapping an activation changes no shard: it is taken, as on the plain model."""
    plain = copy.deepcopy(_net())
    plain.b1.act = nn.Tanh()

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        m = _wrap(pg)
        m.b1.act = nn.Tanh()
        return m(_batches()[0]).detach()

    for out in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(out, plain(_batches()[0]).detach(), atol=1e-6, rtol=0)


def test_an_assignment_on_one_rank_only_raises_on_every_rank() -> None:
    """A value assigned on rank 0 alone would leave each rank with pieces of different models:
    every rank raises at the next forward."""

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(pg)
        if rank == 0:
            m.b1.a.weight = nn.Parameter(torch.zeros(8, 8))
        with pytest.raises(RuntimeError, match="changed differently across ranks"):
            m(_batches()[0])

    run_ranks(WORLD, fn, timeout=30)


def _train_with_writes_through_data(m: nn.Module, rank: int, world: int) -> list[Tensor]:
    """SGD steps, each followed by an EMA evaluation swap written through ``.data`` (diffusers'
    ``EMAModel``: ``copy_to`` by ``p.data.copy_``, ``restore`` by assigning ``p.data``) and a
    decay by ``p.data.mul_`` after that no-grad forward; returns every evaluation's output.
    Elementwise, so each rank's pieces go through what the plain model's parameters do."""
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    params = list(m.parameters())
    ema = [p.detach().clone() for p in params]
    probe = torch.linspace(-1, 1, 16).view(2, 8)
    outs = []
    for x in _batches():
        m(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.mul_(0.5).add_(p.detach(), alpha=0.5)
            stored = [p.detach().clone() for p in params]
            for p, e in zip(params, ema):
                p.data.copy_(e)
            outs.append(m(probe))
            for p, kept in zip(params, stored):
                p.data = kept
            outs.append(m(probe))
            for p in params:
                p.data.mul_(0.99)
    return outs


@pytest.mark.parametrize(
    "stage, tier", [(1, None), (2, None), (3, None), (3, "cpu"), (3, "disk"), (2, "cpu")]
)
def test_writes_through_data_are_the_ones_forward_uses(
    stage: int, tier: str | None, tmp_path: Path
) -> None:
    """``p.data`` writes bypass a tensor's version counter, by which a unit kept gathered (or
    a shard copy staged by the host tier) learns that its shard changed: before, the
    evaluation after a restore still used the EMA weights and training went on from them.
    Every output and the trained weights are the plain model's."""
    plain = copy.deepcopy(_net())
    expected = _train_with_writes_through_data(plain, 0, 1)
    offload = {
        None: None,
        "cpu": Offload(device="cpu"),
        "disk": Offload(device="disk", path=tmp_path),
    }[tier]

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[Tensor], dict[str, Tensor]]:
        m = ShardedModule(
            copy.deepcopy(_net()), process_group=pg, auto_wrap=Block, stage=stage, offload=offload
        )
        return _train_with_writes_through_data(m, rank, WORLD), m.full_state_dict()

    for outs, state in run_ranks(WORLD, fn, timeout=30):
        for out, ref in zip(outs, expected, strict=True):
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("unlike", ["the whole parameter's shape", "another dtype"])
def test_data_assigned_a_tensor_unlike_the_piece_is_refused_naming_the_parameter(
    unlike: str,
) -> None:
    """Refused, naming the parameter, both tensors and the calls that set a whole value;
    nothing changes and the model trains on."""

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(pg)
        before = m.full_state_dict()
        piece = m.b1.a.weight
        if unlike == "another dtype":
            value = torch.zeros_like(piece, dtype=torch.float64)
        else:
            value = torch.zeros(8, 8)
        with pytest.raises(ValueError) as raised:
            piece.data = value
        message = str(raised.value)
        assert message.startswith(
            f"b1.a.weight.data = ... assigns a tensor of shape {tuple(value.shape)} "
            f"({value.dtype}, cpu) to this rank's piece of b1.a.weight, of shape "
            f"{tuple(piece.shape)} (torch.float32, cpu)"
        )
        assert "model.load_state_dict({'b1.a.weight': value}, strict=False)" in message
        assert "model.gathered(writeback=True)" in message
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        _train(m, rank, WORLD)

    run_ranks(WORLD, fn, timeout=30)


@pytest.mark.parametrize("stage", STAGES)
def test_edits_on_one_rank_reach_every_rank_with_modifier_rank(stage: int) -> None:
    """Weights loaded on rank 0 inside ``gathered(modifier_rank=0)`` are the whole model's on
    every rank, each rank's range of them included."""

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, stage)
        with m.gathered(modifier_rank=0):
            if rank == 0:
                for layer in (m.b1.a, m.b2.a, m.head):  # inside the block: full parameters
                    layer.weight.fill_(0.5)
                    layer.bias.fill_(0.5)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in state.values())


@pytest.mark.parametrize("stage", STAGES)
def test_edits_that_differ_across_ranks_are_refused_without_modifier_rank(stage: int) -> None:
    """With ``writeback=True`` alone every rank must edit alike: a parameter edited on rank 0
    only makes every rank raise, naming it, and nothing is written back."""

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(pg, stage)
        before = m.full_state_dict()
        with pytest.raises(ValueError, match="b2.a.weight"):
            with m.gathered(writeback=True):
                m.b1.a.weight.fill_(2.0)  # alike on every rank: fine
                if rank == 0:
                    m.b2.a.weight.fill_(1.0)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        with m.gathered(writeback=True):
            m.b1.a.weight.fill_(2.0)
        assert torch.equal(m.full_state_dict()["b1.a.weight"], torch.full((8, 8), 2.0))

    run_ranks(WORLD, fn, timeout=30)


def _reset_every_module(m: nn.Module) -> None:
    """A model re-initialised after wrapping, as after ``to_empty()``: each module's own
    ``reset_parameters()``."""
    for module in m.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


@pytest.mark.parametrize("stage", STAGES)
def test_reset_parameters_inside_gathered_initialises_the_full_parameters(stage: int) -> None:
    """Inside ``gathered(modifier_rank=0)`` each module's ``reset_parameters()`` runs on its
    full parameters: the model holds what the plain model's reset draws from the same seed
    (Kaiming's range from the layer's input width), on every rank, and trains as it does."""
    plain = copy.deepcopy(_net())
    with torch.random.fork_rng():
        torch.manual_seed(5)
        _reset_every_module(plain)
    reset = {k: v.clone() for k, v in plain.state_dict().items()}
    _train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        m = _wrap(pg, stage)
        with m.gathered(modifier_rank=0):
            if rank == 0:  # the ranks, threads here, share torch's generator: one draws
                with torch.random.fork_rng():
                    torch.manual_seed(5)
                    _reset_every_module(m)
        after_reset = m.full_state_dict()
        _train(m, rank, WORLD)
        return after_reset, m.full_state_dict()

    for after_reset, trained in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(after_reset, reset, atol=0, rtol=0)
        torch.testing.assert_close(trained, dict(plain.state_dict()), atol=1e-5, rtol=0)


def test_reset_parameters_on_pieces_is_refused_naming_the_module_and_the_fix() -> None:
    """Outside ``gathered()`` a module's parameters are this rank's pieces, whose shape is not
    the parameter's: ``reset_parameters()`` is refused before it writes, naming the module and
    ``gathered(modifier_rank=0)``, and the model trains on unchanged."""

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(pg)
        before = m.full_state_dict()
        with pytest.raises(ValueError, match=r"get_submodule\('b1.a'\).reset_parameters\(\)") as e:
            _reset_every_module(m)
        assert "gathered(modifier_rank=0)" in str(e.value) and "meta device" in str(e.value)
        with pytest.raises(ValueError, match=r"get_submodule\('head'\)"):
            m.head.reset_parameters()
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        _train(m, rank, WORLD)

    run_ranks(WORLD, fn, timeout=30)


INITIALISERS = {
    "xavier_uniform_": lambda w, g: nn.init.xavier_uniform_(w, generator=g),
    "kaiming_normal_": lambda w, g: nn.init.kaiming_normal_(w, generator=g),
    "trunc_normal_": lambda w, g: nn.init.trunc_normal_(w, std=0.02, generator=g),
    "normal_": lambda w, g: nn.init.normal_(w, std=0.02, generator=g),
    "uniform_": lambda w, g: nn.init.uniform_(w, -0.1, 0.1, generator=g),
    "Tensor.normal_": lambda w, g: w.normal_(generator=g),
    "orthogonal_": lambda w, g: nn.init.orthogonal_(w, generator=g),
    "eye_": lambda w, g: nn.init.eye_(w),
}


@pytest.mark.parametrize("through_data", [False, True], ids=["param", "param.data"])
@pytest.mark.parametrize("init", INITIALISERS)
def test_a_random_initialiser_on_a_piece_is_refused_and_inside_gathered_initialises_the_whole(
    init: str, through_data: bool
) -> None:
    """On a piece, shape ``(1, n)``, ``nn.init``'s fan-based initialisers would scale by ``n``
    and every rank's piece would draw the same numbers: refused before it writes, naming the
    parameter and the fix, also through ``.data`` (an initialiser written
    ``self.weight.data.normal_()``, which drew on the pieces without a word). So are
    ``orthogonal_`` and ``eye_``, which draw nothing on the piece (they made each piece a
    ``(1, n)`` matrix of their own, every rank's alike, without a word). On the full
    parameter inside ``gathered(modifier_rank=0)`` the same call initialises it as on the plain
    model (rank 0's draws on every rank)."""
    initialise = INITIALISERS[init]
    plain = copy.deepcopy(_net())
    with torch.no_grad():
        initialise(plain.b1.a.weight, torch.Generator().manual_seed(7))

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg)
        before = m.full_state_dict()
        with pytest.raises(ValueError) as error, torch.no_grad():
            w = m.b1.a.weight
            initialise(w.data if through_data else w, torch.Generator().manual_seed(7))
        message = str(error.value)
        assert "on b1.a.weight, this rank's piece of it" in message
        assert "with model.gathered(modifier_rank=0):" in message
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        with m.gathered(modifier_rank=0), torch.no_grad():
            w = m.b1.a.weight
            initialise(w.data if through_data else w, torch.Generator().manual_seed(7 + rank))
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=0, rtol=0)


def test_dirac_on_a_piece_is_refused_before_it_zeroes_it() -> None:
    """``nn.init.dirac_`` zeroes its tensor, then writes ones by position: on a convolution's
    piece it zeroed the piece and then raised at its first positional write. Now refused before
    anything is written, naming the fix; inside ``gathered(modifier_rank=0)`` it initialises
    the full weight as on the plain model."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        conv = nn.Sequential(nn.Conv1d(4, 4, 3), nn.Conv1d(4, 2, 3))
    plain = copy.deepcopy(conv)
    nn.init.dirac_(plain[0].weight.data)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(conv), process_group=pg)
        before = m.full_state_dict()
        with pytest.raises(ValueError, match=r"torch\.nn\.init\.dirac_ on 0\.weight, this rank"):
            nn.init.dirac_(m[0].weight)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        with m.gathered(modifier_rank=0), torch.no_grad():
            nn.init.dirac_(m[0].weight)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=0, rtol=0)


def _removals() -> dict[str, tuple[Callable[[nn.Module], None], Callable[[Net], None]]]:
    """What replaces a layer's parameters by a whole weight computed from them: (how it was set
    up before wrapping, how it is removed after)."""
    from torch.nn.utils import parametrizations, parametrize, prune

    return {
        "remove_parametrizations(orthogonal)": (
            parametrizations.orthogonal,
            lambda m: parametrize.remove_parametrizations(m.b1.a, "weight"),
        ),
        "remove_parametrizations(weight_norm)": (
            parametrizations.weight_norm,
            lambda m: parametrize.remove_parametrizations(m.b1.a, "weight"),
        ),
        "remove_weight_norm": (
            nn.utils.weight_norm,
            lambda m: nn.utils.remove_weight_norm(m.b1.a),
        ),
        "prune.remove": (
            lambda layer: prune.l1_unstructured(layer, "weight", amount=0.5),
            lambda m: prune.remove(m.b1.a, "weight"),
        ),
    }


def _built(setup: Callable[[nn.Module], None]) -> Net:
    m = Net()
    setup(m.b1.a)
    return m


@pytest.mark.parametrize("how", list(_removals()))
def test_removing_a_parametrization_or_pruning_is_refused_with_nothing_changed(how: str) -> None:
    """Removing a parametrization, weight norm or pruning computes the whole weight from the
    layer's parameters and registers it in their place. ``remove_parametrizations`` took the
    parametrization away before the new parameter was refused, losing the trained weight from
    ``full_state_dict()``; ``remove_weight_norm`` crashed the process of a rank whose piece was
    empty (torch's kernel); ``prune.remove`` raised torch's shape error. Each is now refused
    on every rank before anything changes, naming the fix, and training goes on as before."""
    setup, remove = _removals()[how]
    weights = {k: v.clone() for k, v in _built(setup).state_dict().items()}

    def built() -> Net:  # its weight is computed, so it cannot be deep-copied: built anew
        m = _built(setup)
        m.load_state_dict(weights)
        return m

    plain = built()
    _train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(built(), process_group=pg, auto_wrap=Block)
        before = m.full_state_dict()
        with pytest.raises(ValueError, match="full_state_dict") as refused:
            remove(m)
        assert "before wrapping" in str(refused.value)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        _train(m, rank, WORLD)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)


class _Scaled(nn.Module):
    """An elementwise parametrization."""

    def forward(self, x: Tensor) -> Tensor:
        return 2 * x


@pytest.mark.parametrize("what", ["orthogonal weight", "scaled bias"])
def test_a_parametrization_registered_after_wrapping_is_refused_on_every_rank(what: str) -> None:
    """A parametrization registered after wrapping computed on the pieces: an orthogonal one
    was taken (its original registered anew, the next forward failed naming the wrong fix),
    and an elementwise one on a bias split 0 and 3 raised torch's shape error on one rank
    alone, the other waiting in the next forward until the timeout. Now refused on every rank
    before anything changes; training goes on as on the plain model."""
    from torch.nn.utils import parametrizations, parametrize

    plain = copy.deepcopy(_net())
    _train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg)
        with pytest.raises(ValueError, match="register_parametrization .*before wrapping"):
            if what == "orthogonal weight":
                parametrizations.orthogonal(m.b1.a)
            else:
                parametrize.register_parametrization(m.head, "bias", _Scaled())
        assert not parametrize.is_parametrized(m.b1.a) and not parametrize.is_parametrized(m.head)
        _train(m, rank, WORLD)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("apply", ["weight_norm", "spectral_norm"])
def test_weight_norm_applied_after_wrapping_is_refused_with_nothing_changed(apply: str) -> None:
    """``torch.nn.utils.weight_norm`` and ``spectral_norm`` (the functions) delete the layer's
    weight, then register new parameters in its place: the refusal of the first came after the
    deletion, leaving a model without its weight (the next forward failed; a save left it
    out). Now the weight is put back, nothing is changed, and training goes on as on the plain
    model."""
    plain = copy.deepcopy(_net())
    _train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg)
        before, hooks = m.full_state_dict(), dict(m.b1.a._forward_pre_hooks)
        with pytest.warns(FutureWarning) if apply == "weight_norm" else contextlib.nullcontext():
            with pytest.raises(ValueError, match="spectral_norm .* b1.a.weight .*before wrapping"):
                getattr(nn.utils, apply)(m.b1.a)
        assert m.b1.a._forward_pre_hooks == hooks and "weight" in m.b1.a._parameters
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        _train(m, rank, WORLD)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)


def _zero_first_rows(module: nn.Module) -> None:
    """An initialiser that writes by position, as ``model.apply(fn)`` runs it."""
    if isinstance(module, nn.Linear):
        with torch.no_grad():
            module.weight[0].zero_()


@pytest.mark.parametrize("stage", STAGES)
def test_indexing_a_piece_is_refused_and_inside_gathered_indexes_the_whole(stage: int) -> None:
    """``model.apply(fn)`` after wrapping, with ``fn`` writing by position
    (``m.weight[0].zero_()``), and reads by position (``p[0]``, ``p.data[:, :2]``): on a piece
    a position is not the parameter's, so each is refused before it reads or writes, naming
    ``gathered()`` (before: row 0 of each piece, another range on each rank, was zeroed without
    a word). Inside ``gathered(writeback=True)`` the same ``apply`` zeroes each first row as on
    the plain model; a mask of the piece's shape (magnitude pruning) writes elementwise, as on
    the plain model."""
    plain = copy.deepcopy(_net())
    plain.apply(_zero_first_rows)
    with torch.no_grad():
        for p in plain.parameters():
            p[p.abs() < 0.1] = 0.0

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, stage)
        before = m.full_state_dict()
        piece = m.b1.a.weight
        for read in (
            lambda: m.apply(_zero_first_rows),
            lambda: piece[0],
            lambda: piece.data[:, :2],
        ):
            with pytest.raises(IndexError) as raised:
                read()
            assert str(raised.value).startswith("indexing b1.a.weight, this rank's piece of it")
            assert "with model.gathered(writeback=True):" in str(raised.value)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        with m.gathered(writeback=True):
            m.apply(_zero_first_rows)
        with torch.no_grad():
            for p in m.parameters():
                p[p.abs() < 0.1] = 0.0
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=0, rtol=0)


def test_a_rank_raising_inside_gathered_writes_nothing_on_any_rank() -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(pg)
        before = m.full_state_dict()
        expected = (ZeroDivisionError, "") if rank == 1 else (RuntimeError, "a rank raised")
        with pytest.raises(expected[0], match=expected[1]):
            with m.gathered(modifier_rank=0):
                m.b1.a.weight.fill_(3.0)
                if rank == 1:
                    raise ZeroDivisionError
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)

    run_ranks(WORLD, fn, timeout=30)


def test_gathered_arguments_are_checked_before_any_collective() -> None:
    m = ShardedModule(copy.deepcopy(_net()), auto_wrap=Block)
    with pytest.raises(ValueError, match="ranks are 0 to 0"):
        with m.gathered(modifier_rank=1):
            pass
    with pytest.raises(TypeError, match="is an int"):
        with m.gathered(modifier_rank="0"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="drop writeback=False"):
        with m.gathered(writeback=False, modifier_rank=0):
            pass


def test_resize_token_embeddings_is_refused_on_a_sharded_model() -> None:
    """It would read this rank's piece as the whole table: refused, naming the order that
    works; the model is unchanged."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    block = type(model.transformer.h[0])
    m = ShardedModule(model, auto_wrap=block)
    before = m.full_state_dict()
    with pytest.raises(ValueError, match="Resize the unwrapped model, then wrap it"):
        m.resize_token_embeddings(before["transformer.wte.weight"].shape[0] + 8)
    torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
