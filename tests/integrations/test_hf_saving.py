"""``save_pretrained`` on a sharded Hugging Face model, as users call it after training.

Proves, on GPT-2 (head tied to the embedding) and BERT from tiny configs at 2 ranks, after
SGD steps in parity with the unwrapped model:

- ``model.save_pretrained(dir)`` on every rank writes the whole model (rank 0 writes, as
  ``shardwrap.export``), and ``from_pretrained(dir)`` gives the unwrapped trained model's
  weights and logits;
- ``save_pretrained(dir, state_dict=model.full_state_dict(rank0_only=True),
  is_main_process=rank == 0)`` goes through the model class's own ``save_pretrained`` and
  loads back alike;
- accelerate's final line, ``save_pretrained(dir, is_main_process=..., save_function=
  accelerator.save)``, writes it too (``save_function`` is not used, as in transformers);
- a ``state_dict`` of shards, or an option export does not offer, is refused before any
  collective, naming the fix;
- ``load_pretrained`` reads a folder ``transformers`` saved under a model's original
  checkpoint names (a ViT), renaming them as ``from_pretrained`` does, and refuses weights
  ``from_pretrained`` would merge (a Mixtral's experts), naming the fix;
- ``load_pretrained`` of a folder whose tied names hold different values (saved from an
  untied model, which ``from_pretrained`` unties) is refused naming both, and the same values
  load (before: the first name's loaded, the other's dropped without a word); a name saved
  both as it is and under the base model's prefix is refused naming both (before: the later
  one won); a folder holding both ``model.safetensors`` and an index reads the former, as
  ``from_pretrained`` does, with a warning (before: the index, which a plain save can leave
  stale); ``strict=False`` returns the missing and unexpected names, as ``load_state_dict``
  does; a folder of pickled weights alone is named so; names the model's class tells
  ``from_pretrained`` to ignore (GPT-2's ``attn.bias`` causal masks, which older folders hold)
  load as there (before: refused as not in the model, so only ``strict=False`` read them, which
  hides names that are missing).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_saving.py -q``
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule, load_pretrained
from tests.support.models import hf_bert_mlm, hf_gpt2_lm, hf_ids
from tests.support.ranks import run_ranks

WORLD, STEPS, GLOBAL_BATCH, LENGTH = 2, 2, 4, 10


def _batch(step: int) -> Tensor:
    return hf_ids(step, GLOBAL_BATCH, LENGTH)


def _train(model: nn.Module, rank: int, world: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        ids = _batch(step).chunk(world)[rank]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _assert_loads_as(folder: Path, ref: nn.Module) -> None:
    loaded = type(ref).from_pretrained(folder).eval()
    torch.testing.assert_close(loaded.state_dict(), ref.state_dict(), atol=1e-5, rtol=0)
    ids = _batch(99)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, ref.eval()(input_ids=ids).logits, atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("family", [hf_gpt2_lm, hf_bert_mlm], ids=["gpt2", "bert"])
@pytest.mark.parametrize("how", ["plain", "full_state_dict", "accelerate"])
def test_save_pretrained_loads_back_as_the_trained_model(
    family: Any, how: str, tmp_path: Path
) -> None:
    model, layer = family()
    ref = copy.deepcopy(model)
    _train(ref, 0, 1)
    folder = tmp_path / "saved"

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        _train(m, rank, WORLD)
        if how == "plain":
            m.save_pretrained(folder)
        elif how == "accelerate":  # run_clm_no_trainer.py's last line
            m.save_pretrained(folder, is_main_process=rank == 0, save_function=torch.save)
        else:
            full = m.full_state_dict(rank0_only=True)
            m.save_pretrained(folder, state_dict=full, is_main_process=rank == 0)

    run_ranks(WORLD, fn, timeout=60.0)
    assert (folder / "config.json").is_file()
    _assert_loads_as(folder, ref)


def test_shards_and_unsupported_options_are_refused(tmp_path: Path) -> None:
    model, layer = hf_gpt2_lm()

    def fn(rank: int, pg: ProcessGroup) -> int:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        before = sum(m.comm_stats.calls.values())
        with pytest.raises(ValueError, match="full_state_dict"):
            m.save_pretrained(tmp_path / "a", state_dict=m.state_dict())
        with pytest.raises(ValueError, match="push_to_hub.*full_state_dict"):
            m.save_pretrained(tmp_path / "b", push_to_hub=True)
        return sum(m.comm_stats.calls.values()) - before

    assert run_ranks(WORLD, fn) == [0, 0]
    assert not any(tmp_path.iterdir())


def _vit() -> tuple[nn.Module, type]:
    import transformers

    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_hidden_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        intermediate_size=16,
    )
    return transformers.ViTModel(config), transformers.models.vit.modeling_vit.ViTLayer


def _mixtral() -> tuple[nn.Module, type]:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    layer = transformers.models.mixtral.modeling_mixtral.MixtralDecoderLayer
    return transformers.MixtralForCausalLM(config), layer


def test_load_pretrained_reads_a_folder_transformers_saved_under_its_checkpoint_names(
    tmp_path: Path,
) -> None:
    """transformers 5 saves a ViT under its original checkpoint names
    (``encoder.layer.0.attention.attention.key.bias``), which ``from_pretrained`` renames as it
    loads: ``load_pretrained`` renames them alike and loads every rank's pieces, equal to the
    saved model (before: "does not match the model", naming every key)."""
    torch.manual_seed(0)
    saved, layer = _vit()
    saved.save_pretrained(tmp_path / "vit")
    fresh = [_vit()[0] for _ in range(2)]

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(fresh[rank], auto_wrap=layer, process_group=pg, sync_module_states=False)
        load_pretrained(tmp_path / "vit", m)
        return m.full_state_dict()

    for state in run_ranks(2, fn):
        torch.testing.assert_close(state, saved.state_dict(), atol=0, rtol=0)


def test_load_pretrained_of_weights_transformers_merges_is_refused_naming_from_pretrained(
    tmp_path: Path,
) -> None:
    """A Mixtral folder holds each expert's weights apart, which ``from_pretrained`` merges into
    one tensor as it loads: refused on every rank, naming the cause and the two ways to load
    it, before anything is written."""
    torch.manual_seed(0)
    saved, layer = _mixtral()
    saved.save_pretrained(tmp_path / "mixtral")
    fresh = [_mixtral()[0] for _ in range(2)]

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(fresh[rank], auto_wrap=layer, process_group=pg, sync_module_states=False)
        before = m.full_state_dict()
        with pytest.raises(ValueError) as raised:
            load_pretrained(tmp_path / "mixtral", m)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        return str(raised.value)

    for message in run_ranks(2, fn):
        assert "missing from the files: 'model.layers.0.mlp.experts.gate_up_proj'" in message
        assert "model.layers.0.mlp.gate.weight" not in message  # renamed, found
        assert "from_pretrained merges as it loads" in message
        assert "MixtralForCausalLM.from_pretrained(path) before wrapping" in message


def _load_into_wrapped(folder: Path, strict: bool = True) -> list[Any]:
    """Each rank's (full state after, names returned) or (full state, error) of a
    ``load_pretrained`` of ``folder`` into a wrapped GPT-2 seeded apart from the saved one."""
    torch.manual_seed(7)
    fresh, layer = hf_gpt2_lm()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # unlike the saved weights

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], Any, dict[str, Tensor]]:
        m = ShardedModule(copy.deepcopy(fresh), auto_wrap=layer, process_group=pg)
        before = m.full_state_dict()
        try:
            out: Any = load_pretrained(folder, m, strict=strict)
        except (ValueError, FileNotFoundError) as e:
            out = e
        return m.full_state_dict(), out, before

    return run_ranks(WORLD, fn)


def _saved_gpt2(folder: Path, **kwargs: Any) -> nn.Module:
    model, _ = hf_gpt2_lm()
    model.save_pretrained(folder, **kwargs)
    return model


def test_tied_names_holding_different_values_are_refused_and_the_same_values_load(
    tmp_path: Path,
) -> None:
    saved = _saved_gpt2(tmp_path / "same")
    weights = load_file(tmp_path / "same" / "model.safetensors")
    weights["lm_head.weight"] = weights["transformer.wte.weight"].clone()
    save_file(weights, tmp_path / "same" / "model.safetensors", metadata={"format": "pt"})
    for state, _, _ in _load_into_wrapped(tmp_path / "same"):
        torch.testing.assert_close(state, saved.state_dict(), atol=0, rtol=0)
    (tmp_path / "untied").mkdir()
    weights["lm_head.weight"] = torch.randn_like(weights["lm_head.weight"])
    save_file(weights, tmp_path / "untied" / "model.safetensors", metadata={"format": "pt"})
    for state, error, before in _load_into_wrapped(tmp_path / "untied"):
        assert isinstance(error, ValueError), error
        message = str(error)
        assert "'transformer.wte.weight' and 'lm_head.weight' with different values" in message
        assert "tie_word_embeddings=False" in message
        torch.testing.assert_close(state, before, atol=0, rtol=0)


def test_a_name_saved_twice_under_two_prefixes_is_refused_naming_both(tmp_path: Path) -> None:
    _saved_gpt2(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["wte.weight"] = torch.full_like(weights["transformer.wte.weight"], 3.0)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for state, error, before in _load_into_wrapped(tmp_path):
        assert isinstance(error, ValueError), error
        assert "both 'transformer.wte.weight' and 'wte.weight'" in str(error)
        torch.testing.assert_close(state, before, atol=0, rtol=0)


@pytest.mark.parametrize("first", ["one file", "sharded"])
def test_a_folder_holding_one_file_and_an_index_reads_the_file_as_transformers_does(
    tmp_path: Path, first: str
) -> None:
    """A plain save over another of the other layout leaves the first one's weights entry."""
    old = _saved_gpt2(tmp_path, **({"max_shard_size": "20KB"} if first == "sharded" else {}))
    torch.manual_seed(1)
    new, _ = hf_gpt2_lm()
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(2.0)
    new.save_pretrained(tmp_path, **({} if first == "sharded" else {"max_shard_size": "20KB"}))
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "model.safetensors.index.json").is_file()
    read = type(old).from_pretrained(tmp_path).state_dict()
    with pytest.warns(UserWarning, match="holds both model.safetensors and model.safet"):
        results = _load_into_wrapped(tmp_path)
    for state, error, _ in results:
        assert not isinstance(error, Exception), error
        torch.testing.assert_close(state, read, atol=0, rtol=0)


def test_strict_false_returns_the_names_it_skipped(tmp_path: Path) -> None:
    _saved_gpt2(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["transformer.h.1.ln_2.weight"]
    weights["extra.thing"] = torch.zeros(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for _, keys, _ in _load_into_wrapped(tmp_path, strict=False):
        assert keys.missing_keys == ["transformer.h.1.ln_2.weight"]
        assert keys.unexpected_keys == ["extra.thing"]


def test_a_folder_of_pickled_weights_alone_is_named(tmp_path: Path) -> None:
    model, _ = hf_gpt2_lm()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # an older transformers' save
    for _, error, _ in _load_into_wrapped(tmp_path):
        assert isinstance(error, FileNotFoundError), error
        assert "pytorch_model.bin: pickled weights, which it does not read" in str(error)


def test_names_the_models_class_ignores_on_loading_are_ignored_as_from_pretrained_does(
    tmp_path: Path,
) -> None:
    saved = _saved_gpt2(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        weights[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for state, keys, _ in _load_into_wrapped(tmp_path):
        assert keys.missing_keys == [] and keys.unexpected_keys == [], keys
        torch.testing.assert_close(state, saved.state_dict(), atol=0, rtol=0)
    weights["extra.thing"] = torch.zeros(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for _, error, _ in _load_into_wrapped(tmp_path):
        assert isinstance(error, ValueError) and "not in the model: 'extra.thing'" in str(error)
