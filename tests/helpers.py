"""Tiny models and data shared by the tests (no network, a few hundred parameters)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import datasets
import ivon
import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_outputs import SequenceClassifierOutput

from varsmooth import VariationalTrainingArguments
from varsmooth.methods import get_method_config_class
from varsmooth.posterior import derive_seed, optimizer as engine
from varsmooth.posterior.sharding import DTensor, local_slice, to_local

TESTS = Path(__file__).resolve().parent
#: the scripts the tests run as processes of their own (not collected by pytest)
WORKERS = TESTS / "workers"
LAUNCHERS = ("torchrun", "accelerate", "python")


class TinyClassifier(torch.nn.Module):
    """An MLP on flattened 8x8 images. `unused` is a trainable head that never gets a gradient."""

    def __init__(self, in_features: int = 64, hidden: int = 16, num_classes: int = 10, with_unused: bool = False):
        super().__init__()
        self.body = torch.nn.Linear(in_features, hidden)
        self.head = torch.nn.Linear(hidden, num_classes)
        self.unused = torch.nn.Linear(2, 2) if with_unused else None

    def forward(self, pixel_values, labels=None):
        return SequenceClassifierOutput(logits=self.head(torch.tanh(self.body(pixel_values.flatten(1)))))


def digits_dataset(n: int | None = None, seed: int = 0) -> datasets.Dataset:
    """scikit-learn's 8x8 digits as a `datasets.Dataset` with a ClassLabel column."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype("float32")
    y = d.target.astype("int64")
    if n is not None:
        idx = np.random.default_rng(seed).permutation(len(y))[:n]
        x, y = x[idx], y[idx]
    features = datasets.Features({
        "pixel_values": datasets.Array2D((8, 8), "float32"),
        "label": datasets.ClassLabel(names=[str(i) for i in range(10)]),
    })
    return datasets.Dataset.from_dict({"pixel_values": x, "label": y}, features=features).with_format("torch")


def make_args(tmp_path, **kw) -> VariationalTrainingArguments:
    """Quick CPU arguments; keywords that are fields of the method's config (IVON's `ess`, SAM's `sam_rho`, ...) go
    into `method_config`, as benchmarks/common.py's `training_arguments` does."""
    own = {f.name for f in dataclasses.fields(get_method_config_class(kw.get("method", "ivon")))}
    config = {name: kw.pop(name) for name in list(kw) if name in own}
    if config:
        kw["method_config"] = {**kw.get("method_config", {}), **config}
    defaults = dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=16, per_device_eval_batch_size=64, seed=0,
        dataloader_num_workers=0,
    )
    defaults.update(kw)
    return VariationalTrainingArguments(**defaults)


def skip_without_compiler() -> None:
    """Skips a test of IVON's compiled kernels where torch.compile has no C++ compiler to build them with."""
    if not (shutil.which("g++") or shutil.which("clang++")):
        pytest.skip("no C++ compiler for torch.compile")


def indexed_noise(p: torch.Tensor, index: int, draw_seed: int) -> torch.Tensor:
    """e of parameter `index` in the draw seeded by `draw_seed` (derive_seed(sample_seed, step, draw), the same on every
    rank): float32 `randn` of the whole parameter's shape from a CPU generator seeded by derive_seed(draw_seed, index);
    of a DTensor, this shard's part of it."""
    gen = torch.Generator().manual_seed(derive_seed(draw_seed, index))
    whole = torch.randn(p.shape, generator=gen)
    return local_slice(p, whole) if isinstance(p, DTensor) else whole  # a shard: its part of the whole draw


def draw_indexed_noise(bucket, draw_seed: int, into: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """In place of `varsmooth.posterior.optimizer.draw_noise`: `indexed_noise` on every path, kept or not (the kernels
    then take e as an argument instead of drawing it), so that other optimizers and layouts can draw the same e."""
    noise = [indexed_noise(p, i, draw_seed).to(to_local(p)) for p, i in zip(bucket.params, bucket.indices)]
    if into is None:
        return noise
    torch._foreach_copy_(into, noise)
    return into


def give_indexed_noise(monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Every VariationalIVON draws `indexed_noise`: through `monkeypatch`, or for the rest of the process (workers)."""
    if monkeypatch is None:
        engine.draw_noise = draw_indexed_noise
    else:
        monkeypatch.setattr(engine, "draw_noise", draw_indexed_noise)


class SeededIVON(ivon.IVON):
    """ivon-opt's `IVON`, unchanged except for its Gaussian draw: by default the noise VariationalIVON draws on the
    CPU (for draw d after step t, the parameters of each param group split by (device, dtype) into buckets numbered
    b = 0, 1, ... over all groups; bucket b's tensors drawn in turn from one generator seeded by
    derive_seed(derive_seed(seed, t, d), rank, b)); or `noise(p, index, derive_seed(seed, t, d))` where given
    (`indexed_noise`)."""

    def __init__(self, params, *, seed: int = 0, rank: int = 0, noise=None, **kwargs):
        super().__init__(params, **kwargs)
        self.seed, self.rank, self.draws, self.noise = seed, rank, 0, noise

    def _draw_all(self) -> list[torch.Tensor]:
        params = [p for g in self.param_groups for p in g["params"]]
        base, noise, number, index = derive_seed(self.seed, self.current_step, self.draws), {}, 0, 0
        if self.noise is not None:
            return [self.noise(p, i, base).to(p) for i, p in enumerate(params)]
        for group in self.param_groups:
            buckets: dict = {}
            for p in group["params"]:
                buckets.setdefault((p.device, p.dtype), []).append((index, p))
                index += 1
            for bucket in buckets.values():
                gen = torch.Generator().manual_seed(derive_seed(base, self.rank, number))
                number += 1
                for i, p in bucket:
                    noise[i] = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device)
        return [noise[i] for i in range(len(params))]

    def _sample_params(self):
        noise_samples, param_avgs, e = [], [], iter(self._draw_all())
        for group in self.param_groups:
            flat = torch.cat([next(e).flatten() for _ in group["params"]])
            noise = flat / (group["ess"] * (group["hess"] + group["weight_decay"])).sqrt()
            noise_samples.append(noise)
            offset = 0
            for p in group["params"]:
                param_avgs.append(p.data.flatten())
                p.data = (p.data.flatten() + noise[offset:offset + p.numel()]).view(p.shape)
                offset += p.numel()
        self.draws += 1
        return torch.cat(param_avgs), torch.cat(noise_samples)

    def step(self, closure=None):
        loss = super().step(closure)
        self.draws = 0
        return loss


def reference_ivon_loop(model, batches_per_step, steps, *, lr, ess, hess_init, beta1, beta2, wd, seed, mc_samples=1,
                        clip_norm=0.0, rank=0, loss_scale=1.0, noise=None, frozen_mean=()):
    """The ivon-opt README loop, written out by hand, with the noise drawn as VariationalIVON draws it.

    `batches_per_step(step)` returns the micro-batches [(x, y), ...] of that optimizer step; the parameters of the
    modules named in `frozen_mean` go in a second param group at learning rate 0.
    """
    model = copy.deepcopy(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    frozen = [p for n, p in named if n.rpartition(".")[0] in frozen_mean]
    groups = params if not frozen else [{"params": [p for p in params if all(p is not f for f in frozen)]},
                                        {"params": frozen, "lr": 0.0}]
    opt = SeededIVON(groups, seed=seed, rank=rank, lr=lr, ess=ess, hess_init=hess_init, beta1=beta1, beta2=beta2,
                     weight_decay=wd, noise=noise)
    for step in range(steps):
        for x, y in batches_per_step(step):
            for _ in range(mc_samples):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x).logits, y)  # micro-batch mean, no 1/GA
                    (loss * loss_scale).backward()
                    if clip_norm:
                        torch.nn.utils.clip_grad_norm_(params, clip_norm)
        opt.step()
    return model, opt


def load_example(name: str) -> ModuleType:
    """An example script (examples/<name>.py) as a module, to test its functions without running it."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def tiny_digits_resnet(seed: int = 0):
    """A seeded 2-stage ResNet for 1-channel 8x8 digits with named labels (HF classes: saves, reloads and serves)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    return ResNetForImageClassification(ResNetConfig(
        num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10,
        downsample_in_first_stage=False, id2label={i: str(i) for i in range(10)},
        label2id={str(i): i for i in range(10)}))


def digits_images(n: int) -> datasets.Dataset:
    """`digits_dataset(n)` with `pixel_values` as 1-channel 8x8 images, for convolutional models."""
    ds = digits_dataset(n).with_format(None)
    return ds.map(lambda b: {"pixel_values": np.asarray(b["pixel_values"], "float32")[:, None]},
                  batched=True).with_format("torch")


def noisy_digits_images(n_val: int):
    """(train, val, processor, transform): 256 digits training images with 40 % symmetric noise, the first `n_val` test
    images as clean validation, the image processor and the batch transform that turns images into model inputs."""
    from transformers import ViTImageProcessor

    from example_utils.data import load_digits_dataset
    from varsmooth.corruption import corrupt_labels

    data = load_digits_dataset()
    train = corrupt_labels(data["train"].select(range(256)), "symmetric", 0.4, seed=0)
    processor = ViTImageProcessor(do_resize=False, image_mean=[0.5], image_std=[0.5], do_convert_rgb=False)

    def transform(batch):
        return {"pixel_values": processor(batch["image"], return_tensors="pt")["pixel_values"],
                "labels": torch.as_tensor(batch["label"])}

    return train, data["test"].select(range(n_val)), processor, transform


def run_script(script: str | os.PathLike, *args: str, launcher: str = "torchrun", nproc: int = 2,
               env: dict[str, str | None] | None = None, timeout: float = 300, check: bool = True,
               ) -> subprocess.CompletedProcess:
    """Runs `script` with `args` in processes of its own and waits for them: under `torchrun --nproc_per_node nproc`,
    under the README's `accelerate launch --multi_gpu --num_processes nproc` (both meeting on a free local port), or as
    one plain `python` process (nproc=1).

    The processes get this one's environment with no GPU, OMP_NUM_THREADS=1 and tests/ and examples/ on PYTHONPATH (the
    workers import helpers, test modules and example_utils, as the tests do under pytest), then `env` on top (a None
    value unsets that variable). A run still going after `timeout` seconds is killed, all its processes with it, and
    fails the test. With `check`, so does a nonzero exit, with the tail of its stderr; without, the caller checks it.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is not one of {LAUNCHERS}")
    if launcher == "python" and nproc != 1:
        raise ValueError(f"launcher='python' runs one process, not nproc={nproc}: pass nproc=1 or launcher='torchrun'")
    bin_dir = os.path.dirname(sys.executable)
    if launcher == "python":
        command = [sys.executable]
    else:
        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        command = ([os.path.join(bin_dir, "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                    "--master_port", port] if launcher == "torchrun" else
                   [os.path.join(bin_dir, "accelerate"), "launch", "--multi_gpu", "--num_processes", str(nproc),
                    "--main_process_port", port])
    path = [str(TESTS), str(TESTS.parent / "examples"), *filter(None, [os.environ.get("PYTHONPATH")])]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(path)}
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    proc = subprocess.Popen([*command, os.fspath(script), *args], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own, out of reach of a kill of the launcher's process
        # group: find the whole tree while the launcher still holds it, then kill all of it
        tree = []
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{os.path.basename(script)} ran past {timeout} s and was killed with all its processes; "
                    f"the tail of its stderr:\n{stderr[-4000:]}")
    if check:
        assert proc.returncode == 0, f"{os.path.basename(script)} exited with {proc.returncode}:\n{stderr[-4000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


class TensorInput(torch.nn.Module):
    """An HF image classifier called with one tensor, as torch.optim.swa_utils.update_bn calls models."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits
