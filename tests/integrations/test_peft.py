"""PEFT LoRA on a sharded Llama: training, saving, merging, counting and generating.

Proves, on Llama from a tiny config at 2 ranks, wrapped as ``ShardedModule(get_peft_model(model,
config), auto_wrap=LlamaDecoderLayer)``, at stages 2 and 3:

- AdamW steps on the per-rank halves of each global batch leave the LoRA weights of the
  unwrapped PEFT model trained on the whole batch, the base weights untouched, and optimizer
  state only for LoRA weights;
- ``print_trainable_parameters()`` reports the unwrapped model's counts;
- ``save_pretrained(dir)`` on every rank writes an adapter that ``PeftModel.from_pretrained``
  loads onto the base model as the trained adapter (same weights, same logits);
- ``merge_and_unload()`` returns the unwrapped model's merged model (same weights, logits),
  and is refused before any collective for a base model it cannot build again;
- ``generate()`` with prompts that end at different steps on the two ranks gives each rank
  the unwrapped model's output (no rank left waiting); ``synced_gpus=False`` is refused
  before any collective;
- at stage 2, the frozen base weights are not kept whole between steps: memory between steps
  and at peak stays within a quarter of one layer's frozen weights of stage 3's (tracked
  allocations);
- adding adapters to a model that is already sharded is refused, naming the order to use;
- at the suite's stage, with two adapters added before wrapping, ``set_adapter`` on the sharded
  model trains the adapter it activates like the unwrapped model (the other keeps its weights
  and gets no optimizer state), ``save_pretrained`` writes both and they load back to the
  trained weights and logits, and ``add_adapter`` on the sharded model is refused (as are
  ``merge_adapter`` and ``unmerge_adapter``, which merge in place);
- at the suite's stage, ``modules_to_save=["lm_head"]``: the head's copy trains like the
  unwrapped model's, is written into the adapter file and loads back exactly.

``shardwrap.hf.Trainer`` on a PEFT model, under torchrun: ``tests/e2e/test_hf_trainer.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_peft.py -q``
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardwrap import ShardedModule, track_allocations
from tests.support.models import HF_VOCAB, hf_ids, tiny_llama_config
from tests.support.ranks import run_ranks

WORLD, STEPS, GLOBAL_BATCH, LENGTH, NEW_TOKENS = 2, 3, 4, 10, 8

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _collect_sharded_models() -> Iterator[None]:
    """Free each test's sharded models before the next test (one collection frees them):
    tests that check the process-wide optimizer hooks are gone with the last sharded model
    run after these."""
    yield
    gc.collect()


def _lora() -> LoraConfig:
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
    )


def _models() -> tuple[nn.Module, nn.Module]:
    """The base model and a PEFT model of a copy of it (same base weights)."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_llama_config())
    return base, get_peft_model(copy.deepcopy(base), _lora())


def _train(model: nn.Module, rank: int, world: int) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        ids = hf_ids(step, GLOBAL_BATCH, LENGTH).chunk(world)[rank]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def _printed(model: Any) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.print_trainable_parameters()
    return out.getvalue()


def _logits(model: nn.Module) -> Tensor:
    with torch.no_grad():
        return model(input_ids=hf_ids(99, 2, LENGTH)).logits


def _sharded_and_trained(
    stage: int, after: Callable[[nn.Module, int], T]
) -> tuple[nn.Module, nn.Module, list[T]]:
    """The base model, the unwrapped PEFT model trained on the global batches, and what
    ``after(model, rank)`` returns on each rank once the sharded PEFT model took the same steps."""
    base, peft_model = _models()
    ref = copy.deepcopy(peft_model)
    _train(ref, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> T:
        m = ShardedModule(
            copy.deepcopy(peft_model), auto_wrap=LlamaDecoderLayer, process_group=pg, stage=stage
        )
        _train(m, rank, WORLD)
        return after(m, rank)

    return base, ref.eval(), run_ranks(WORLD, fn, timeout=60.0)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_training_matches_the_plain_peft_model(stage: int) -> None:
    _, peft_model = _models()
    ref = copy.deepcopy(peft_model)
    _train(ref, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], int, list[str]]:
        m = ShardedModule(
            copy.deepcopy(peft_model), auto_wrap=LlamaDecoderLayer, process_group=pg, stage=stage
        )
        opt = _train(m, rank, WORLD)
        names = {id(p): n for n, p in m.named_parameters()}
        return m.full_state_dict(), len(opt.state), sorted(names[id(p)] for p in opt.state)

    lora = sorted(n for n, p in peft_model.named_parameters() if p.requires_grad)
    assert len(lora) == 8  # lora_A and lora_B of q_proj and v_proj, 2 layers
    start = peft_model.state_dict()
    for full, states, with_state in run_ranks(WORLD, fn, timeout=60.0):
        torch.testing.assert_close(full, ref.state_dict(), atol=1e-5, rtol=0)
        assert states == 8 and with_state == lora
        changed = {k for k, v in full.items() if not torch.equal(v, start[k])}
        assert changed == {k for k in start if ".lora_" in k}


@pytest.mark.parametrize("stage", [2, 3])
def test_print_trainable_parameters_counts_whole_parameters(stage: int) -> None:
    _, ref, printed = _sharded_and_trained(stage, lambda m, rank: _printed(m))
    assert printed == [_printed(ref)] * WORLD


@pytest.mark.parametrize("stage", [2, 3])
def test_save_pretrained_writes_the_adapter_as_from_pretrained_loads_it(
    stage: int, tmp_path: Path
) -> None:
    folder = tmp_path / "adapter"
    base, ref, _ = _sharded_and_trained(stage, lambda m, rank: m.save_pretrained(folder))
    assert len(load_file(folder / "adapter_model.safetensors")) == 8  # the LoRA weights alone
    loaded = PeftModel.from_pretrained(base, folder).eval()
    torch.testing.assert_close(loaded.state_dict(), ref.state_dict(), atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(loaded), _logits(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_merge_and_unload_gives_the_plain_models_merged_model(stage: int) -> None:
    _, ref, merged = _sharded_and_trained(stage, lambda m, rank: m.merge_and_unload())
    want = ref.merge_and_unload()
    for got in merged:
        assert type(got) is type(want)
        torch.testing.assert_close(got.state_dict(), want.state_dict(), atol=1e-5, rtol=0)
        torch.testing.assert_close(_logits(got.eval()), _logits(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["merge_adapter", "unmerge_adapter"])
def test_merging_in_place_is_refused_naming_merge_and_unload(method: str) -> None:
    """``merge_adapter()`` adds each adapter's product into its base weight in place: on a
    sharded model those are this rank's pieces (before: torch's "mat1 and mat2 shapes cannot be
    multiplied"). Refused on every rank naming ``merge_and_unload()``, nothing changed: the
    model computes as the trained plain PEFT model's after it."""

    def after(m: nn.Module, rank: int) -> Tensor:
        with pytest.raises(TypeError, match=r"merge_and_unload\(\) on every rank"):
            getattr(m, method)()
        return _logits(m.eval())

    _, ref, logits = _sharded_and_trained(3, after)
    for got in logits:
        torch.testing.assert_close(got, _logits(ref), atol=1e-4, rtol=0)


def test_merge_and_unload_of_a_base_model_without_a_config_is_refused() -> None:
    torch.manual_seed(0)
    model = get_peft_model(nn.Sequential(nn.Linear(8, 8)), LoraConfig(target_modules=["0"]))

    def fn(rank: int, pg: ProcessGroup) -> int:
        m = ShardedModule(copy.deepcopy(model), process_group=pg)
        before = sum(m.comm_stats.calls.values())
        with pytest.raises(TypeError, match="merge there"):
            m.merge_and_unload()
        return sum(m.comm_stats.calls.values()) - before

    assert run_ranks(WORLD, fn) == [0, 0]


def _generate(model: nn.Module, prompt: Tensor, eos: int | None = None) -> Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=prompt,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=eos,
        )


def _uneven(model: nn.Module) -> tuple[list[Tensor], int]:
    """Two prompts and an end token that the first one's greedy continuation meets early and
    the second one's never does."""
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, HF_VOCAB, (1, 5), generator=g) for _ in range(WORLD)]
        first, second = (_generate(model, p)[0, -NEW_TOKENS:].tolist() for p in prompts)
        early = [t for t in first[: NEW_TOKENS // 2] if t not in second and t > 1]
        if early:
            return prompts, early[0]
    raise AssertionError("no pair of prompts ends at different steps")


@pytest.mark.parametrize("stage", [2, 3])
def test_generate_with_ranks_finishing_at_different_steps_matches_the_plain_model(
    stage: int,
) -> None:
    _, peft_model = _models()
    peft_model.eval()
    prompts, eos = _uneven(peft_model)
    want = [_generate(peft_model, p, eos) for p in prompts]
    assert want[0].shape[1] < want[1].shape[1]

    def fn(rank: int, pg: ProcessGroup) -> tuple[Tensor, int]:
        m = ShardedModule(
            copy.deepcopy(peft_model), auto_wrap=LlamaDecoderLayer, process_group=pg, stage=stage
        )
        with pytest.raises(ValueError, match="Leave synced_gpus unset"):
            m.generate(input_ids=prompts[rank], synced_gpus=False)
        refused_calls = sum(m.comm_stats.calls.values())
        return _generate(m, prompts[rank], eos), refused_calls

    for rank, (got, refused_calls) in enumerate(run_ranks(WORLD, fn, timeout=30.0)):
        assert torch.equal(got, want[rank])
        assert refused_calls == 0


def _tracked(peft_model: nn.Module, stage: int) -> list[tuple[int, int]]:
    """Each rank's tracked peak and the bytes alive after two steps, from wrapping on."""

    def fn(rank: int, pg: ProcessGroup) -> tuple[int, int]:
        model = copy.deepcopy(peft_model)
        with track_allocations() as tracked:
            m = ShardedModule(model, auto_wrap=LlamaDecoderLayer, process_group=pg, stage=stage)
            _train(m, rank, WORLD)
            between = tracked.live()
        return tracked.peak, between

    return run_ranks(WORLD, fn, timeout=60.0)


def test_stage_2_keeps_no_full_copy_of_the_frozen_base_weights() -> None:
    _, peft_model = _models()
    frozen_layer = 4 * sum(
        p.numel() for n, p in peft_model.named_parameters() if ".layers.0." in n and "lora" not in n
    )
    for (peak2, between2), (peak3, between3) in zip(
        _tracked(peft_model, 2), _tracked(peft_model, 3)
    ):
        # Before, stage 2 kept both layers' frozen weights whole between steps; now only
        # their LoRA weights.
        assert between2 - between3 < frozen_layer / 4, (between2, between3, frozen_layer)
        assert peak2 - peak3 < frozen_layer / 4, (peak2, peak3, frozen_layer)


def test_adapters_added_to_a_sharded_model_are_refused() -> None:
    base, _ = _models()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=LlamaDecoderLayer, process_group=pg)
        with pytest.raises(TypeError, match=r"ShardedModule\(get_peft_model\(model, config\)"):
            get_peft_model(m, _lora())

    run_ranks(WORLD, fn)


def test_load_adapter_loads_saved_weights_into_its_own_adapter_and_refuses_a_new_one(
    tmp_path: Path,
) -> None:
    """``load_adapter(dir, name)`` into an adapter the model has loads the saved weights (what
    the Trainer's ``load_best_model_at_end`` and resume do with an adapter-only checkpoint,
    ``save_only_model``: refused, it had failed the run once training ended); a new adapter
    is still refused."""
    folder = tmp_path / "adapter"
    _, peft_model = _models()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(peft_model), auto_wrap=LlamaDecoderLayer, process_group=pg)
        _train(m, rank, WORLD)
        m.save_pretrained(folder)
        saved = m.full_state_dict()
        _train(m, rank, WORLD)
        moved = m.full_state_dict()
        assert any(not torch.equal(moved[k], v) for k, v in saved.items())  # trained on
        m.load_adapter(folder, "default", is_trainable=True)
        torch.testing.assert_close(m.full_state_dict(), saved, atol=0, rtol=0)
        with pytest.raises(TypeError, match="load_adapter of a new adapter .* fixed"):
            m.load_adapter(folder, "other")

    run_ranks(WORLD, fn, timeout=60.0)


def test_the_trainer_loads_the_best_adapter_of_an_adapter_only_checkpoint(tmp_path: Path) -> None:
    """``shardwrap.hf.Trainer`` with ``save_only_model``: the checkpoint holds the adapter
    alone, which ``load_best_model_at_end`` loads (it had looked for the whole model's files)."""
    import shardwrap.hf

    _, peft_model = _models()
    m = ShardedModule(peft_model, auto_wrap=LlamaDecoderLayer)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = shardwrap.hf.Trainer(model=m, args=args)
    _train(m, 0, 1)
    m.save_pretrained(tmp_path / "checkpoint-3")
    best = m.full_state_dict()
    _train(m, 0, 1)
    trainer.state.best_model_checkpoint = str(tmp_path / "checkpoint-3")
    trainer._load_best_model()
    torch.testing.assert_close(m.full_state_dict(), best, atol=0, rtol=0)


def _two_adapters() -> tuple[nn.Module, nn.Module]:
    """The base model and a PEFT model of a copy of it with adapters ``one`` (q and v) and
    ``two`` (v alone, rank 2), ``one`` active."""
    base, _ = _models()
    model = get_peft_model(copy.deepcopy(base), _lora(), adapter_name="one")
    model.add_adapter(
        "two", LoraConfig(task_type="CAUSAL_LM", r=2, lora_dropout=0.0, target_modules=["v_proj"])
    )
    return base, model


def test_set_adapter_trains_the_active_one_and_save_pretrained_writes_each(
    tmp_path: Path,
) -> None:
    """At the suite's stage: ``set_adapter("two")`` on the sharded model switches which adapter
    the forward uses and which trains; ``one`` keeps its weights and gets no optimizer state;
    ``save_pretrained`` writes both adapters, and they load back onto a fresh base model to the
    trained weights and logits."""
    base, peft_model = _two_adapters()
    ref = copy.deepcopy(peft_model)
    ref.set_adapter("two")
    _train(ref, 0, 1)
    ref.eval()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], list[str]]:
        m = ShardedModule(copy.deepcopy(peft_model), auto_wrap=LlamaDecoderLayer, process_group=pg)
        m.set_adapter("two")
        opt = _train(m, rank, WORLD)
        names = {id(p): n for n, p in m.named_parameters()}
        m.save_pretrained(folder)
        with pytest.raises(TypeError, match="Add or load every adapter first"):
            m.add_adapter("three", _lora())
        return m.full_state_dict(), sorted(names[id(p)] for p in opt.state)

    folder = tmp_path / "adapters"
    two = sorted(n for n, _ in ref.named_parameters() if ".two." in n)
    start = peft_model.state_dict()
    for full, with_state in run_ranks(WORLD, fn, timeout=60.0):
        torch.testing.assert_close(full, ref.state_dict(), atol=1e-5, rtol=0)
        assert with_state == two
        changed = {k for k, v in full.items() if not torch.equal(v, start[k])}
        assert changed == {k for k in start if ".two." in k}
    # one folder per adapter (peft's layout for adapters not named "default")
    assert len(load_file(folder / "one" / "adapter_model.safetensors")) == 8
    assert len(load_file(folder / "two" / "adapter_model.safetensors")) == 4
    loaded = PeftModel.from_pretrained(base, folder / "one", adapter_name="one")
    loaded.load_adapter(folder / "two", adapter_name="two")
    torch.testing.assert_close(loaded.state_dict(), ref.state_dict(), atol=1e-5, rtol=0)
    loaded.set_adapter("two")
    torch.testing.assert_close(_logits(loaded.eval()), _logits(ref), atol=1e-4, rtol=0)


def test_modules_to_save_trains_saves_and_loads_exactly(tmp_path: Path) -> None:
    """At the suite's stage: LoRA with ``modules_to_save=["lm_head"]``: the head's trainable
    copy trains like the unwrapped model's on the global batch, the original head stays, and
    the adapter file holds the trained head, which loads back exactly."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_llama_config())
    config = _lora()
    config.modules_to_save = ["lm_head"]
    peft_model = get_peft_model(copy.deepcopy(base), config)
    ref = copy.deepcopy(peft_model)
    _train(ref, 0, 1)
    ref.eval()
    folder = tmp_path / "adapter"

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(peft_model), auto_wrap=LlamaDecoderLayer, process_group=pg)
        _train(m, rank, WORLD)
        m.save_pretrained(folder)
        return m.full_state_dict()

    head = "base_model.model.lm_head.modules_to_save.default.weight"
    for full in run_ranks(WORLD, fn, timeout=60.0):
        torch.testing.assert_close(full, ref.state_dict(), atol=1e-5, rtol=0)
        assert not torch.equal(full[head], peft_model.state_dict()[head])  # it trained
    saved = load_file(folder / "adapter_model.safetensors")
    assert "base_model.model.lm_head.weight" in saved and len(saved) == 9
    loaded = PeftModel.from_pretrained(base, folder).eval()
    torch.testing.assert_close(loaded.state_dict(), ref.state_dict(), atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(loaded), _logits(ref), atol=1e-4, rtol=0)
