"""Minimal repro: accelerate 1.15's FSDP2 preparation fails on HF's ViT, BERT, ResNet and on BatchNorm buffers.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/accelerate_fsdp2_repro.py

No varsmooth and no GPU involved: two CPU processes over gloo call `accelerate.utils.fsdp_utils.fsdp2_prepare_model`
(what `Accelerator.prepare` runs for FSDP2) with the transformer-based wrap policy (`_no_split_modules`), on tiny
configs. With accelerate 1.15 and transformers 5.24:

* ViT and BERT: `_no_split_modules` names their embeddings module, which the wrap policy shards; accelerate then
  calls `fully_shard` again on `get_input_embeddings()`, a child of that module whose parameters are already
  DTensors, and torch fails ("Invariant encountered: value was None" in `DeviceMesh._concatenate`);
* ResNet: accelerate calls `model.get_input_embeddings()` unguarded, and transformers raises NotImplementedError for
  a model without input embeddings;
* any model with buffers in its state dict (BatchNorm's statistics), with `cpu_ram_efficient_loading` (the default of
  `accelerate launch --use_fsdp`): `fsdp2_load_full_state_dict` takes every state-dict entry for a DTensor and fails
  on the buffers ("'Tensor' object has no attribute 'device_mesh'"); shown on a plain Linear + BatchNorm.

Sharding beforehand (`fully_shard` each module whose class is in `_no_split_modules`, then the model) avoids the
first two: `fsdp2_prepare_model` returns a model that is already an FSDP2 module as it is. VariationalTrainer works
around all three itself (`varsmooth.trainer.fsdp.shardable_by_accelerate`).
"""

import os
import types

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import fully_shard
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    ResNetConfig,
    ResNetForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)

MODELS = {
    "vit": (lambda: ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                                                        num_hidden_layers=2, num_attention_heads=2,
                                                        intermediate_size=32)),
            lambda: {"pixel_values": torch.randn(2, 1, 8, 8)}),
    "bert": (lambda: BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                              num_attention_heads=2, intermediate_size=32)),
             lambda: {"input_ids": torch.randint(0, 50, (2, 8))}),
    "resnet": (lambda: ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16],
                                                                  depths=[1, 1])),
               lambda: {"pixel_values": torch.randn(2, 1, 8, 8)}),
}


MODELS["batchnorm"] = (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
                      lambda: {"input": torch.randn(2, 4)})


def accelerator_stub(efficient_loading: bool = False) -> types.SimpleNamespace:
    """The attributes of `Accelerator` that `fsdp2_prepare_model` reads."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            cpu_ram_efficient_loading=efficient_loading)
    return types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                 mixed_precision="no", device=torch.device("cpu"), is_main_process=dist.get_rank() == 0)


def shard_beforehand(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module)
    fully_shard(model)
    return model


def main() -> None:
    dist.init_process_group("gloo")
    for name, (make, inputs) in MODELS.items():
        if name == "batchnorm":
            ways = (("efficient loading", lambda m: m, True), ("without it", lambda m: m, False))
        else:
            ways = (("accelerate", lambda m: m, False), ("sharded beforehand", shard_beforehand, False))
        for how, prepare, efficient_loading in ways:
            torch.manual_seed(0)
            try:
                model = fsdp2_prepare_model(accelerator_stub(efficient_loading), prepare(make()))
                output = model(**inputs())
                getattr(output, "logits", output).sum().backward()
                result = "trains"
            except Exception as error:  # noqa: BLE001 - the failure is what this script shows
                result = f"fails: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            if dist.get_rank() == 0:
                print(f"{name:9s} {how:18s} {result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # gloo's worker threads can abort the interpreter's teardown
