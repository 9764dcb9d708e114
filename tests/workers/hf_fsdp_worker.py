"""Run by tests/test_engine.py under `torchrun --nproc_per_node 2`: HF's ViT and BERT (tiny configs) under FSDP2.

The models are sharded as a user may shard them beforehand (`fully_shard` on each of `_no_split_modules`'
layers, then the root: accelerate then keeps the model as it is, once VariationalTrainer has turned off the wrap
policy that accelerate would otherwise look up by class name), and trained as VariationalTrainer trains them:
reshard, one IVON sample per step, forward and backward on each rank's half of the global batch. Halfway the model
and optimizer are saved with torch.distributed.checkpoint; a fresh sharded model restored from it finishes the run
again. The posterior is gathered and saved (rank 0 writes). Rank 0 repeats the run unsharded on the whole batches.
The noise is given (`indexed_noise`), so that the sharded run and the unsharded one draw the same samples.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

from helpers import give_indexed_noise
from varsmooth.posterior import DiagonalGaussianPosterior, VariationalIVON
from varsmooth.posterior.gaussian import _reshard
from varsmooth.trainer.fsdp import keep_presharded_model

STEPS, BATCH = 6, 8
IVON_KW = dict(lr=0.1, ess=200.0, hess_init=0.3, beta1=0.9, beta2=0.99, weight_decay=1e-2)


def make_model(kind):
    torch.manual_seed(0)
    if kind == "vit":
        return ViTForImageClassification(ViTConfig(
            image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, num_labels=3,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def shard(model):
    """Sharded beforehand: each layer of `_no_split_modules` its own FSDP2 unit, then the root."""
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module)
    fully_shard(model)
    return model


def batches(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "vit":
        x = torch.randn(STEPS, BATCH, 1, 8, 8, generator=g)
        key = "pixel_values"
    else:
        x = torch.randint(0, 50, (STEPS, BATCH, 8), generator=g)
        key = "input_ids"
    return key, x, torch.randint(0, 3, (STEPS, BATCH), generator=g)


def build(kind, sharded):
    model = make_model(kind)
    if sharded:
        shard(model)
    opt = VariationalIVON(model.parameters(), sample_seed=4, rank=dist.get_rank(), **IVON_KW)
    give_indexed_noise()
    return model, opt


def train(kind, model, opt, steps, part, parts):
    key, x, y = batches(kind)
    size = BATCH // parts
    rows = slice(part * size, (part + 1) * size)
    for step in steps:
        _reshard(model)  # as VariationalTrainer: IVON writes the sample into the shards
        with opt.sampled_params(train=True):
            opt.zero_grad()
            F.cross_entropy(model(**{key: x[step, rows]}).logits, y[step, rows]).backward()
        opt.step()


def snapshot(model, opt):
    return {"weights": torch.cat([p.full_tensor().flatten() if hasattr(p, "full_tensor") else p.detach().flatten()
                                  for p in model.parameters()]), "hessian": opt.hessian(), "step": opt.current_step}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for kind in ("vit", "bert"):
        model, opt = build(kind, sharded=True)
        assert type(next(model.parameters())).__name__ == "DTensor"
        # what `Accelerator.prepare` does first with `fsdp_config={"version": 2}` (transformer-based wrap policy)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        keep_presharded_model(plugin, model)  # as VariationalTrainer does; accelerate 1.15 raises without it
        plugin.set_auto_wrap_policy(model)
        wraps_nothing = plugin.auto_wrap_policy is None
        train(kind, model, opt, range(STEPS // 2), rank, world)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, kind, "ckpt"))
        train(kind, model, opt, range(STEPS // 2, STEPS), rank, world)
        names = [n for n, _ in model.named_parameters()]
        gathered = DiagonalGaussianPosterior.from_ivon(model, opt, names, {"step": opt.current_step}).gathered()
        if rank == 0:
            gathered.save(os.path.join(out, kind, "sharded.safetensors"))
        result = {"sharded": snapshot(model, opt), "wraps_nothing": wraps_nothing}

        fresh, fresh_opt = build(kind, sharded=True)
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(out, kind, "ckpt"))
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(kind, fresh, fresh_opt, range(STEPS // 2, STEPS), rank, world)
        result["resumed"] = snapshot(fresh, fresh_opt)
        if rank == 0:
            plain, plain_opt = build(kind, sharded=False)
            train(kind, plain, plain_opt, range(STEPS), 0, 1)
            result["plain"] = snapshot(plain, plain_opt)
            DiagonalGaussianPosterior.from_ivon(plain, plain_opt, [n for n, _ in plain.named_parameters()],
                                                {"step": plain_opt.current_step}).save(
                os.path.join(out, kind, "plain.safetensors"))
        results[kind] = result
    torch.save(results, os.path.join(out, f"hf_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # gloo's worker threads can abort the interpreter's teardown after the results are on disk
