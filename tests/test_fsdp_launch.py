"""FSDP2 as `accelerate launch --use_fsdp --fsdp_version 2` sets it up, on 2 CPU processes over gloo: VariationalTrainer
trains HF's ViT, BERT and ResNet with accelerate's own FSDP2 preparation, which fails on each of them by itself
(benchmarks/accelerate_fsdp2_repro.py), exports each example's label noise, and saves weights and posterior that load
in another process.

accelerate drops an FSDP plugin on CPU processes (it trains with DDP there): the worker keeps it, as accelerate does
on GPUs (tests/workers/fsdp_on_cpu.py). The environment is the launcher's, with the transformer-based wrap policy
(the one that shards ViT's and BERT's embeddings twice) and the default `cpu_ram_efficient_loading`.
"""

import math

import datasets
import numpy as np
import pytest
import torch

from helpers import WORKERS, run_script
from varsmooth import VariationalModel

pytestmark = pytest.mark.slow

LAUNCH_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
              "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
              "FSDP_SYNC_MODULE_STATES": "true", "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("kind", ["vit", "bert", "resnet"])
def test_the_trainer_shards_hf_models_through_accelerates_fsdp2_preparation(tmp_path, kind):
    run_script(WORKERS / "fsdp_launch_worker.py", str(tmp_path), kind, env=LAUNCH_ENV)
    result = torch.load(tmp_path / kind / "result.pt", weights_only=True)
    assert result["step"] == 4 and math.isfinite(result["loss"])
    trained, initial = result["trained"], result["initial"]
    assert trained.keys() == initial.keys()
    assert all(torch.isfinite(w).all() for w in trained.values())
    assert max((trained[n] - initial[n]).abs().max() for n in trained) > 1e-3
    assert torch.isfinite(result["hessian"]).all() and (result["hessian"] - result["hess_init"]).abs().max() > 1e-4
    if kind == "bert":  # its word embeddings' mean is frozen (the worker's frozen_mean_modules), their σ learned
        embeddings = "bert.embeddings.word_embeddings.weight"
        assert torch.equal(trained[embeddings], initial[embeddings])

    model = VariationalModel.from_pretrained(tmp_path / kind / "model", num_samples=2)
    stds = torch.cat([s.flatten() for s in model.posterior.std.values()])
    assert model.posterior.std.keys() == trained.keys()
    assert torch.isfinite(stds).all() and (stds > 0).all() and stds.std() > 0  # σ learned per weight, not the prior's
    if kind == "bert":
        assert model.posterior.std[embeddings].std() > 0
    for name, p in model.model.named_parameters():  # the gathered full state is what was saved
        assert torch.equal(p.detach(), trained[name]), name

    # the export ran on both processes (σ gathered, each measuring its shard) and wrote every example once
    noise = datasets.Dataset.from_parquet(str(tmp_path / kind / "label_noise.parquet"))
    magnitude = np.asarray(noise["noise_l1"])
    assert len(noise) == 128 and np.isfinite(magnitude).all() and (magnitude > 0).all() and magnitude.std() > 0
