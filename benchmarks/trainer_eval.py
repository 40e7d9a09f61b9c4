"""Seq2SeqTrainer.evaluate() end to end on the small T5, the way a user runs it: beam search
through ``predict_with_generate``, per method; ``benchmarks/t5_compare.py`` reports it.

    torchrun --standalone --nproc_per_node=2 benchmarks/trainer_eval.py \\
        shardwrap-s3 '{"rows": 64, "beams": 4, "tokens": 16, "batch": 8, "repeats": 3}' OUT.json

The T5 is ``benchmarks/generate.py``'s (random weights, the same seed on every rank); the eval
set is ``rows`` rows of 32 random bytes as input, each labelled with its first ``tokens``
bytes, built here (nothing is downloaded). Every method evaluates with the same
``Seq2SeqTrainingArguments`` (:func:`arguments`): ``predict_with_generate=True``,
``generation_num_beams=beams``, ``generation_max_length=tokens + 1`` (the decoder's start
token and ``tokens`` new ones), ``per_device_eval_batch_size=batch``, ``use_cpu=True`` with
``ddp_backend="gloo"``, ``save_strategy="no"``, ``report_to=[]``,
``dataloader_num_workers=0``; the model's generation config adds ``min_new_tokens=tokens``, so
that every row decodes the same steps, as in ``generate.py``. A ``compute_metrics`` keeps the
generated tokens: without one, ``evaluate()`` (transformers 5.23) computes the loss alone and
generates nothing. Methods:

- ``ddp``: the stock ``transformers.Seq2SeqTrainer`` on the plain model (it wraps the model in
  DDP to train; it evaluates the plain model on every rank);
- ``shardwrap-s2``, ``shardwrap-s3``: ``shardwrap.hf.Seq2SeqTrainer`` on ``ShardedModule(model,
  auto_wrap=T5Block, stage=s)``, whose ``evaluate()`` keeps the units gathered for the whole
  call where the model fits;
- ``fsdp2``: the stock ``Seq2SeqTrainer`` on the model with ``fully_shard`` on every
  ``T5Block`` and the root and ``generate`` registered as a forward method (what the Trainer
  does to the model its FSDP2 prepared); the Trainer's own FSDP2 does not shard on CPU (see
  the ``NOTE`` in :func:`worker`).

Each rank times every ``evaluate()`` call from a barrier, in wall and process CPU time: one
untimed call, then ``repeats`` timed ones. Rank 0 writes the slowest rank's wall times, the
busiest rank's CPU times, every timed call's ``eval_loss``, the predictions ``compute_metrics``
saw in the last call (every row's generated tokens, gathered by the Trainer, in the eval set's
order), the ``synced_gpus`` the Trainer passed to ``generate()``, and for shardwrap its
collectives per call.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import end_ranks, torchrun_json  # noqa: E402
from generate import fsdp2_t5, t5_model  # noqa: E402

METHODS = ("ddp", "shardwrap-s2", "shardwrap-s3", "fsdp2")
LENGTH = 32  # bytes per input row, as generate.py's


def settings_of(args: Any) -> dict[str, int]:
    """What the worker needs of ``t5_compare.py``'s arguments."""
    fields = ("rows", "beams", "tokens", "repeats")
    return {"batch": args.eval_batch, **{k: getattr(args, k) for k in fields}}


def time_evaluate(method: str, args: Any, timeout: float | None = None) -> dict[str, Any]:
    """Time ``method``'s ``evaluate()`` in fresh ``torchrun`` processes (``args``: ``nproc``,
    ``rows``, ``beams``, ``tokens``, ``repeats``, ``eval_batch``): its worker's result, or its
    ``error``."""
    result = torchrun_json(
        Path(__file__).resolve(),
        method,
        json.dumps(settings_of(args)),
        nproc=args.nproc,
        timeout=timeout,
    )
    return {"method": method, **result}


def eval_rows(rows: int, tokens: int) -> list[dict[str, torch.Tensor]]:
    """``rows`` rows of ``LENGTH`` random bytes (2 to 255; 0 and 1 are T5's padding and end),
    each labelled with its first ``tokens`` bytes; the same on every rank."""
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(2, 256, (rows, LENGTH), generator=g)
    return [{"input_ids": x, "labels": x[:tokens].clone()} for x in inputs]


def arguments(settings: dict[str, int], out: str) -> Any:
    """The ``Seq2SeqTrainingArguments`` every method evaluates with (see the module
    docstring)."""
    import transformers

    return transformers.Seq2SeqTrainingArguments(
        output_dir=out,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_eval_batch_size=settings["batch"],
        predict_with_generate=True,
        generation_num_beams=settings["beams"],
        generation_max_length=settings["tokens"] + 1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )


class Predictions:
    """``compute_metrics`` that keeps the generated tokens it is shown and adds no metric."""

    def __init__(self) -> None:
        self.last: Any = None

    def __call__(self, prediction: Any) -> dict[str, float]:
        self.last = prediction.predictions
        return {}


def wrap(method: str, model: torch.nn.Module) -> tuple[torch.nn.Module, type]:
    """``model`` as ``method`` evaluates it, and its Trainer class."""
    import transformers
    from transformers.models.t5.modeling_t5 import T5Block

    if method.startswith("shardwrap"):
        import shardwrap.hf
        from shardwrap import ShardedModule

        sharded = ShardedModule(model, auto_wrap=T5Block, stage=int(method[-1]))
        return sharded, shardwrap.hf.Seq2SeqTrainer
    if method == "fsdp2":
        # NOTE: the Trainer's own FSDP2 (fsdp=True, fsdp_config={"version": 2, ...}) does not
        # shard on CPU: accelerate 1.15 keeps an FSDP plugin only for accelerator devices, not
        # for use_cpu=True (MULTI_CPU), where the Trainer then evaluates the plain model
        # without a word (is_fsdp_enabled False). So the model is sharded here as accelerate
        # shards it (every T5Block, then the root), generate() registered as the Trainer does.
        fsdp2_t5(model)
        return model, transformers.Seq2SeqTrainer
    if method == "ddp":
        return model, transformers.Seq2SeqTrainer
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def worker(method: str, settings: dict[str, int], out: str) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    model = t5_model()
    model.generation_config.min_new_tokens = settings["tokens"]
    model, trainer_class = wrap(method, model)
    stats = getattr(model, "comm_stats", None)  # shardwrap's
    predictions = Predictions()
    synced: set[bool | None] = set()
    generate = model.generate

    def recorded(*args: Any, **kwargs: Any) -> Any:
        synced.add(kwargs.get("synced_gpus"))  # what the Trainer passes
        return generate(*args, **kwargs)

    model.generate = recorded
    with tempfile.TemporaryDirectory() as work:
        trainer = trainer_class(
            model=model,
            args=arguments(settings, work),
            eval_dataset=eval_rows(settings["rows"], settings["tokens"]),
            compute_metrics=predictions,
        )

        def call() -> tuple[float, float, float]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            metrics = trainer.evaluate()
            took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return took[0].item(), took[1].item(), metrics["eval_loss"]

        call()
        if stats is not None:
            stats.reset()
        calls = [call() for _ in range(settings["repeats"])]
    times = [wall for wall, _, _ in calls]
    result: dict[str, Any] = {
        "seconds": statistics.median(times),
        "times": times,
        "cpu_seconds": statistics.median(cpu for _, cpu, _ in calls),
        "cpu_times": [cpu for _, cpu, _ in calls],
        "eval_losses": [loss for _, _, loss in calls],
        "predictions": predictions.last.tolist(),
        "evaluated_as": type(trainer.model_wrapped).__name__,
        "synced_gpus": sorted(synced, key=str),
    }
    if stats is not None:
        repeats = settings["repeats"]
        result["collectives"] = {k: n / repeats for k, n in stats.calls.items()}
        result["gather_mb"] = stats.bytes.get("all_gather", 0) / repeats / 2**20
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    end_ranks()


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])
