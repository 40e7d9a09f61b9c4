"""Weights loaded on rank 0 only before wrapping: rank 0's are copied to every rank.

The habit served by ``sync_module_states`` in other wrappers: rank 0 loads a checkpoint into
the plain model, the other ranks keep their fresh initialisation, then everyone wraps. Without
care each rank would keep pieces of a different model. Proves, on Llama and BERT from tiny
configs, against the unwrapped model started from the loaded weights and trained on the whole
global batch:

- ``sync_module_states=True`` copies rank 0's parameters and buffers, at 2 ranks and at
  2 x 2 hybrid sharding, and training is then in parity;
- by default the tensors that differ are copied from rank 0 too, as DDP does, with a warning
  on every rank naming them and the choices, and training is in parity;
- ``sync_module_states=False`` skips the check for weights loaded after wrapping;
- ``model.apply(model._init_weights)`` (a model re-initialised after wrapping) runs inside
  ``gathered(modifier_rank=0)`` on the full parameters, as on the plain model, and is refused
  on pieces, naming the module and the fix (before: Llama's embedding table was zeroed on every
  rank, its padding row being the whole piece).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_init.py -q``
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule, load_pretrained
from tests.support.hybrid import hybrid_mesh
from tests.support.models import HF_VOCAB, tiny_bert_config, tiny_llama_config
from tests.support.parity import train_steps
from tests.support.ranks import run_ranks

STEPS, GLOBAL_BATCH, LENGTH = 3, 8, 10


def _llama(seed: int) -> tuple[nn.Module, type]:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    return model, transformers.models.llama.modeling_llama.LlamaDecoderLayer


def _bert(seed: int) -> tuple[nn.Module, type]:
    torch.manual_seed(seed)
    model = transformers.BertForMaskedLM(tiny_bert_config())
    return model, transformers.models.bert.modeling_bert.BertLayer


def _batch(step: int) -> Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(2, HF_VOCAB, (GLOBAL_BATCH, LENGTH), generator=g)


def _lm_loss(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    return model(input_ids=ids, labels=labels).loss


def _train(model: nn.Module, rank: int, world: int, pg: ProcessGroup | None) -> list[float]:
    adamw = lambda params: torch.optim.AdamW(params, lr=3e-3)  # noqa: E731
    batches = [(_batch(step), _batch(step)) for step in range(STEPS)]
    return train_steps(model, rank, world, pg, adamw, batches, _lm_loss)


@pytest.mark.parametrize("family", [_llama, _bert], ids=["llama", "bert"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["2", "2x2"])
def test_rank0_weights_are_copied_with_sync_module_states(family: Any, hybrid: bool) -> None:
    world = 4 if hybrid else 2
    pretrained, layer = family(seed=1)
    checkpoint = copy.deepcopy(pretrained.state_dict())
    fresh = [family(seed=10 + r)[0] for r in range(world)]  # each rank's own initialisation
    ref = copy.deepcopy(pretrained)
    ref_losses = _train(ref, 0, 1, None)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor]]:
        model = fresh[rank]
        if rank == 0:
            model.load_state_dict(checkpoint)
        group = hybrid_mesh(pg) if hybrid else pg
        m = ShardedModule(model, auto_wrap=layer, process_group=group, sync_module_states=True)
        return _train(m, rank, world, pg), m.full_state_dict()

    for losses, state in run_ranks(world, fn, timeout=60.0):
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", [_llama, _bert], ids=["llama", "bert"])
def test_weights_differing_across_ranks_are_copied_from_rank0_by_default(family: Any) -> None:
    pretrained, layer = family(seed=1)
    checkpoint = copy.deepcopy(pretrained.state_dict())
    fresh = [family(seed=10 + r)[0] for r in range(2)]
    ref = copy.deepcopy(pretrained)
    ref_losses = _train(ref, 0, 1, None)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor]]:
        if rank == 0:
            fresh[rank].load_state_dict(checkpoint)
        m = ShardedModule(fresh[rank], auto_wrap=layer, process_group=pg)
        return _train(m, rank, 2, pg), m.full_state_dict()

    # the ranks are threads: their warnings are recorded here, in the main thread
    with pytest.warns(UserWarning, match="sync_module_states=True") as warned:
        results = run_ranks(2, fn, timeout=60.0)
    messages = [str(w.message) for w in warned if "differed across ranks" in str(w.message)]
    assert len(messages) == 2  # one per rank
    assert "rank 0's were copied to every rank" in messages[0]
    assert "embed" in messages[0] or "embeddings" in messages[0]  # names the tensors
    for losses, state in results:
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


def test_loading_after_wrapping_skips_the_check(tmp_path: Any) -> None:
    pretrained, layer = _llama(seed=1)
    pretrained.save_pretrained(tmp_path / "pretrained")
    fresh = [_llama(seed=10 + r)[0] for r in range(2)]

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(fresh[rank], auto_wrap=layer, process_group=pg, sync_module_states=False)
        load_pretrained(tmp_path / "pretrained", m)
        return m.full_state_dict()

    for state in run_ranks(2, fn):
        torch.testing.assert_close(state, pretrained.state_dict(), atol=0, rtol=0)


def _padded(family: Any, seed: int) -> tuple[nn.Module, type]:
    """The family's model with padding row 0 in its token embedding (BERT's by default)."""
    model, layer = family(seed)
    config = model.config
    config.pad_token_id = 0
    torch.manual_seed(seed)
    return type(model)(config), layer


def _init_every_module(model: nn.Module) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(5)
        model.apply(model._init_weights)


@pytest.mark.parametrize("family", [_llama, _bert], ids=["llama", "bert"])
def test_init_weights_inside_gathered_initialises_the_full_parameters(family: Any) -> None:
    model, layer = _padded(family, seed=1)
    plain = copy.deepcopy(model)
    _init_every_module(plain)
    initialised = copy.deepcopy(plain.state_dict())
    if family is _llama:  # its padding row zeroed (BERT's initialiser leaves it drawn)
        assert not initialised["model.embed_tokens.weight"][0].any()
    ref_losses = _train(plain, 0, 1, None)

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], list[float]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        with m.gathered(modifier_rank=0):
            if rank == 0:  # the ranks, threads here, share torch's generator: one draws
                _init_every_module(m)
        return m.full_state_dict(), _train(m, rank, 2, pg)

    for state, losses in run_ranks(2, fn, timeout=60.0):
        torch.testing.assert_close(state, initialised, atol=0, rtol=0)
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)


def test_init_weights_on_pieces_is_refused_naming_the_module_and_the_fix() -> None:
    model, layer = _padded(_llama, seed=1)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        before = m.full_state_dict()
        with pytest.raises(ValueError) as raised:
            _init_every_module(m)
        message = str(raised.value)
        assert message.startswith(
            "shardwrap: model._init_weights(model.get_submodule('model.embed_tokens')) would "
            "initialise this rank's pieces of weight"
        )
        assert "with model.gathered(modifier_rank=0): model.apply(model._init_weights)" in message
        inner = r"get_submodule\('model'\)._init_weights\(model.get_submodule\('model.norm'\)\)"
        with pytest.raises(ValueError, match=inner):
            m.model._init_weights(m.model.norm)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)

    run_ranks(2, fn, timeout=60.0)
