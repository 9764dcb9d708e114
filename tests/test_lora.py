"""IVON over peft LoRA adapters: the trainer's guarantees for full models hold for adapters.

The "pretrained" model is a tiny BERT built from a config (no network); dropout is off so that the hand-written
reference loop sees the same forward passes as the trainer.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys

import datasets
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from example_utils.models import create_image_classifier
from helpers import WORKERS, load_example, make_args, reference_ivon_loop, run_script
from varsmooth import LabelNoiseCallback, VariationalTrainer, VariationalTrainingArguments
from varsmooth.adapters import add_lora_adapters
from varsmooth.methods import METHODS
from varsmooth.presets import LORA_PRESET

pytest.importorskip("peft")

IVON_KW = dict(lr=0.2, hess_init=0.5, beta1=0.9, beta2=0.999, wd=2e-4)
VOCAB, LENGTH, CLASSES = 40, 8, 3


def tiny_bert(seed: int = 0, dtype: torch.dtype = torch.float32) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=CLASSES,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).to(dtype)


def token_dataset(n: int = 64, seed: int = 0) -> datasets.Dataset:
    """Random sentences whose label is set by their first token (learnable), with clean/corrupted columns."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    clean = ids[:, 0] % CLASSES
    noisy = clean.clone()
    noisy[: n // 4] = (noisy[: n // 4] + 1) % CLASSES
    names = datasets.ClassLabel(names=[str(k) for k in range(CLASSES)])
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")), "label": names,
                                  "clean_label": names, "is_corrupted": datasets.Value("bool")})
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "label": noisy.tolist(),
                                       "clean_label": clean.tolist(),
                                       "is_corrupted": (noisy != clean).tolist()},
                                      features=features).with_format("torch")


def lora_bert(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return add_lora_adapters(tiny_bert(seed, dtype), r=4, alpha=8)


def _args(tmp_path, **kw) -> VariationalTrainingArguments:
    # ivon-opt's settings, as the hand-written loops run them: the scratch preset's ess (N) and rescaled, unclipped lr
    # (on an adapter the trainer would choose the lora preset)
    base = dict(ivon_preset="scratch", learning_rate=IVON_KW["lr"], hess_init=IVON_KW["hess_init"],
                beta1=IVON_KW["beta1"],
                beta2=IVON_KW["beta2"], prior_precision=IVON_KW["wd"], lr_scheduler_type="constant",
                max_grad_norm=0.0, train_sampling_strategy="sequential", remove_unused_columns=False)
    base.update(kw)
    return make_args(tmp_path, **base)


def _train_rows(ds: datasets.Dataset) -> datasets.Dataset:
    return ds.remove_columns(["clean_label", "is_corrupted"])


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


# -- preset ------------------------------------------------------------------------------------------------------
def test_lora_preset_is_the_ivon_lora_recipe(tmp_path):
    """Cong et al. 2024's numbers: no lr rescaling, clip 1e-3, ess in 1e6-1e8, h0 in 3e-4-1e-3, 10 samples; the
    learning rate makes the largest step lr·clip_radius AdamW-LoRA's 1e-3 (their 0.03 does not train in short runs)."""
    args = make_args(tmp_path, ivon_preset="lora")
    ivon = args.method_config
    assert (ivon.rescale_lr, ivon.clip_radius, args.eval_mc_samples) == (False, 1e-3, 10)
    assert args.learning_rate * ivon.clip_radius == pytest.approx(1e-3)
    assert 1e6 <= ivon.ess <= 1e8 and 3e-4 <= ivon.hess_init <= 1e-3 and ivon.prior_precision == 0.0
    fields = {name: value for name, value in LORA_PRESET.items() if name != "long_run_beta2"}
    assert {name: getattr(args, name, getattr(ivon, name, None)) for name in fields} == fields
    # the default β2: the anchor's 0.99999 only in runs long enough for it to move the Hessian
    assert ivon.beta2 is None
    kept = make_args(tmp_path, ivon_preset="lora", learning_rate=0.1, eval_mc_samples=4)
    assert (kept.learning_rate, kept.eval_mc_samples, kept.method_config.ess) == (0.1, 4, LORA_PRESET["ess"])
    # a non-IVON method keeps its own learning rate; the default number of BMA samples is unchanged elsewhere
    assert make_args(tmp_path, method="erm").learning_rate == 5e-5
    assert make_args(tmp_path, ivon_preset="scratch").eval_mc_samples == 32
    # with no preset named, the trainer chooses it (and with it these defaults) from the model it is handed
    assert make_args(tmp_path).eval_mc_samples is None and make_args(tmp_path).learning_rate is None
    with pytest.raises(ValueError, match="ivon_preset must be one of"):
        make_args(tmp_path, ivon_preset="qlora")


# -- building adapters -------------------------------------------------------------------------------------------
def test_adapters_train_only_lora_and_the_head():
    model = lora_bert()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("lora_A" in n or "lora_B" in n) and (".query." in n or ".value." in n)
                             or "classifier.modules_to_save" in n for n in trainable)
    assert any("classifier.modules_to_save" in n for n in trainable)
    assert sum("lora_A" in n for n in trainable) == 4  # query and value of both layers


def test_missing_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(ImportError, match=r"varsmooth\[lora\]"):
        add_lora_adapters(tiny_bert())


def test_bad_lora_settings_and_unknown_targets():
    with pytest.raises(ValueError, match="r > 0"):
        add_lora_adapters(tiny_bert(), r=0)

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="lora_target_modules"):
        add_lora_adapters(Plain())


def test_timm_vit_gets_adapters_on_the_fused_qkv_and_a_trained_head():
    model = create_image_classifier("vit_tiny_patch16_224", {0: "a", 1: "b"})
    peft_model = add_lora_adapters(model)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert sum(".attn.qkv.lora_A" in n for n in trainable) == len(model.timm_model.blocks)
    assert any("timm_model.head.modules_to_save" in n for n in trainable)
    assert all("lora_" in n or ".head." in n for n in trainable)


# -- training ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grad_accum,mc_samples", [(1, 1), (2, 2)])
def test_adapter_training_matches_hand_written_ivon_loop(tmp_path, grad_accum, mc_samples):
    """Adapter weights and Hessian equal the ivon-opt loop over the trainable weights; the base stays untouched."""
    ds = token_dataset(64)
    model = lora_bert()
    init, frozen = copy.deepcopy(model), _frozen(model)
    steps, batch = 3, 8
    args = _args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=grad_accum, max_steps=steps,
                 mc_samples=mc_samples)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=_train_rows(ds))
    trainer.train()
    x, y = ds[:]["input_ids"], ds[:]["label"]

    def batches(step):
        start = step * batch * grad_accum
        return [(x[start + k * batch: start + (k + 1) * batch], y[start + k * batch: start + (k + 1) * batch])
                for k in range(grad_accum)]

    ref, ref_opt = reference_ivon_loop(init, batches, steps, ess=len(ds), seed=0, mc_samples=mc_samples, **IVON_KW)
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6, msg=name)
    torch.testing.assert_close(trainer.ivon.hessian(), ref_opt.param_groups[0]["hess"], atol=1e-6, rtol=1e-6)
    assert (trainer.ivon.hessian() - 0.5).abs().max() > 1e-3
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert set(trainer.method.param_names) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_adapter_resume_is_exact(tmp_path):
    ds = _train_rows(token_dataset(128))
    common = dict(max_steps=6, per_device_train_batch_size=8, gradient_accumulation_steps=2, lr_scheduler_type="cosine",
                  warmup_steps=2, train_sampling_strategy="random")
    full = VariationalTrainer(model=lora_bert(), args=_args(tmp_path / "full", **common), train_dataset=ds)
    full.train()
    half_args = _args(tmp_path / "half", save_strategy="steps", save_steps=3, **common)
    VariationalTrainer(model=lora_bert(), args=half_args, train_dataset=ds).train()
    assert os.path.isfile(tmp_path / "half" / "checkpoint-3" / "adapter_model.safetensors")
    # a fresh process: initial weights
    resumed = VariationalTrainer(model=lora_bert(), args=half_args, train_dataset=ds)
    resumed.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-3"))
    a, b = _trainable(full.model), _trainable(resumed.model)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(full.ivon.hessian(), resumed.ivon.hessian())
    assert resumed.ivon.current_step == full.ivon.current_step == 6


def test_bf16_base_with_fp32_adapters(tmp_path):
    """A base loaded in bfloat16 stays frozen in bfloat16; adapters and head train in float32 and the Hessian learns."""
    model = lora_bert(dtype=torch.bfloat16)
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert dtypes == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    frozen = _frozen(model)
    before = _trainable(model)
    trainer = VariationalTrainer(model=model,
                                 args=_args(tmp_path, max_steps=3, bf16=True, per_device_train_batch_size=8),
                                 train_dataset=_train_rows(token_dataset(32)))
    trainer.train()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert (trainer.ivon.hessian() - 0.5).abs().max() > 1e-3
    assert torch.isfinite(torch.as_tensor(trainer.evaluate(_train_rows(token_dataset(16)))["eval_nll"]))


def test_bf16_head_without_the_cast_is_refused(tmp_path):
    """The check the cast in add_lora_adapters avoids: a bfloat16 trainable head is refused with the fix named."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_bert(dtype=torch.bfloat16),
                           LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"]))
    trainer = VariationalTrainer(model=model, args=_args(tmp_path, max_steps=1),
                                 train_dataset=_train_rows(token_dataset(16)))
    with pytest.raises(ValueError, match="IVON needs fp32 trainable weights"):
        trainer.train()


def test_gradient_checkpointing_gives_the_same_adapters(tmp_path):
    ds = _train_rows(token_dataset(32))
    runs = []
    for checkpointing in (False, True):
        model = lora_bert()
        trainer = VariationalTrainer(model=model, args=_args(tmp_path / str(checkpointing), max_steps=3,
                                                              per_device_train_batch_size=8,
                                                              gradient_checkpointing=checkpointing), train_dataset=ds)
        trainer.train()
        runs.append((_trainable(model), trainer.ivon.hessian().clone()))
    (a, ha), (b, hb) = runs
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)
    torch.testing.assert_close(ha, hb, atol=1e-6, rtol=1e-6)
    assert (ha - 0.5).abs().max() > 1e-3  # the adapters did get gradients through the checkpointed layers


def test_label_noise_export_over_adapter_samples(tmp_path):
    ds = token_dataset(32)
    trainer = VariationalTrainer(model=lora_bert(), args=_args(tmp_path, max_steps=2, per_device_train_batch_size=8),
                                 train_dataset=ds, callbacks=[LabelNoiseCallback(num_samples=4)])
    trainer.train()
    assert os.path.isfile(tmp_path / "label_noise.parquet") and os.path.isfile(tmp_path / "label_noise_summary.json")
    exported = datasets.Dataset.from_parquet(str(tmp_path / "label_noise.parquet"))
    noise = trainer.label_noise(num_samples=4)
    assert len(noise) == len(exported) == len(ds)
    assert list(noise["is_corrupted"]) == list(ds.with_format(None)["is_corrupted"])
    # the posterior is over the adapters and the head only, with a nonzero std
    posterior = trainer.posterior()
    assert set(posterior.std) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert posterior.summary()["posterior_std_mean"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_only_the_adapters(tmp_path, method):
    if method == "sam":
        pytest.importorskip("pytorch_optimizer")
    model = lora_bert()
    frozen, before = _frozen(model), _trainable(model)
    extra = {"method_config": {"alasca_num_classifiers": 1, "alasca_warmup_epochs": 1.0}} if method == "alasca" else {}
    args = make_args(tmp_path, method=method, max_steps=2, per_device_train_batch_size=8, remove_unused_columns=False,
                     learning_rate=1e-2 if method not in ("ivon", "ivon_fixed_hessian") else None, **extra)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=_train_rows(token_dataset(32)))
    trainer.train()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad and n in frozen)
    changed = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed)  # B starts at 0: it moved, so the adapters trained
    assert "eval_accuracy" in trainer.evaluate(_train_rows(token_dataset(16)))


@pytest.mark.slow
def test_ddp_adapter_replicas_identical(tmp_path):
    run_script(WORKERS / "ddp_lora_worker.py", str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["world_size"] == 2 and ranks[0]["sync"]
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
    assert all(torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]) for n in ranks[0]["params"])
    assert torch.equal(ranks[0]["hess"], ranks[1]["hess"])
    assert (ranks[0]["hess"] - 0.5).abs().max() > 1e-3
    # the frozen base is the initial one on both ranks
    init = lora_bert()
    for name, p in init.named_parameters():
        if not p.requires_grad:
            assert torch.equal(ranks[0]["frozen"][name], p.detach()), name


# -- examples ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["train_text_classification", "train_image_classification"])
def test_examples_switch_to_the_lora_preset(name):
    example = load_example(name)
    model_args, *_, training_args = example.parse_arguments(["--lora_r", "8", "--use_cpu", "true"])
    assert model_args.lora_enabled and (model_args.lora_r, model_args.lora_alpha) == (8, 16)
    assert (training_args.method_config.ivon_preset == "lora"
            and training_args.learning_rate == LORA_PRESET["learning_rate"])
    assert training_args.eval_mc_samples == 10
    chosen = example.parse_arguments(["--lora_r", "8", "--ivon_preset", "finetune", "--use_cpu", "true"])[-1]
    assert chosen.method_config.ivon_preset == "finetune"
    assert not example.parse_arguments(["--use_cpu", "true"])[0].lora_enabled


# -- saving, loading, serving ------------------------------------------------------------------------------------
def tiny_tokenizer(folder) -> BertTokenizer:
    os.makedirs(folder, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, VOCAB)]
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return BertTokenizer(path, do_lower_case=True)


def trained_adapter(tmp_path, layers_kept: int = 2):
    """A LoRA classifier on a saved "pretrained" BERT of 3 layers cut to `layers_kept`, trained and saved with IVON."""
    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=32,
                        max_position_embeddings=LENGTH + 2, num_labels=CLASSES, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, id2label={k: f"class{k}" for k in range(CLASSES)},
                        label2id={f"class{k}": k for k in range(CLASSES)})
    BertForSequenceClassification(config).save_pretrained(base_dir)
    tokenizer = tiny_tokenizer(tmp_path / "vocab")
    model = BertForSequenceClassification.from_pretrained(base_dir, num_hidden_layers=layers_kept)
    model = add_lora_adapters(model, r=4, alpha=8)
    args = _args(tmp_path / "run", max_steps=4, per_device_train_batch_size=8, eval_mc_samples=4, eval_seed=3)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=_train_rows(token_dataset(64)),
                                 processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    return trainer, tokenizer


def test_adapter_folder_saves_the_posterior_under_peft_names_and_loads_back(tmp_path):
    from safetensors import safe_open

    from varsmooth import VariationalModel

    trainer, _ = trained_adapter(tmp_path)
    out = tmp_path / "run"
    assert {"adapter_model.safetensors", "adapter_config.json", "config.json",
            "posterior.safetensors"} <= set(os.listdir(out))
    with safe_open(out / "adapter_model.safetensors", "pt") as a, safe_open(out / "posterior.safetensors", "pt") as p:
        assert set(p.keys()) == set(a.keys())  # one σ beside every saved adapter weight, under the same name
        for key in a.keys():
            assert p.get_tensor(key).shape == a.get_tensor(key).shape

    trainer.create_model_card()  # the card names the file that holds the posterior mean: the adapter's
    assert "whose mean is the model's weights (`adapter_model.safetensors`)" in (out / "README.md").read_text()

    loaded = VariationalModel.from_pretrained(out)
    assert len(loaded.model.get_base_model().bert.encoder.layer) == 2  # the cut recorded in config.json
    assert loaded.num_samples == 4 and loaded.seed == 3
    assert set(loaded.posterior.std) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    ds = _train_rows(token_dataset(16, seed=1))
    expected = torch.as_tensor(trainer.predict(ds).predictions).exp()
    with torch.no_grad():
        got = loaded(input_ids=ds[:]["input_ids"]).probs
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # BMA over adapter samples differs from the mean adapter's prediction
        mean = VariationalModel.from_pretrained(out, num_samples=0)(input_ids=ds[:]["input_ids"]).probs
    assert (mean - got).abs().max() > 1e-6


def test_pipeline_serves_the_adapter_with_its_posterior(tmp_path):
    from varsmooth import VariationalModel, pipeline

    _, tokenizer = trained_adapter(tmp_path)
    out = tmp_path / "run"
    texts = ["w5 w9 w12", "w30 w7", "w21 w22 w23 w24"]
    classify = pipeline("text-classification", model=str(out))
    results = classify(texts, top_k=None)
    loaded = VariationalModel.from_pretrained(out)
    with torch.no_grad():
        expected = loaded(**tokenizer(texts, return_tensors="pt", padding=True)).probs
    for row, probs in zip(results, expected):
        scores = {r["label"]: r["score"] for r in row}
        assert set(scores) == {f"class{k}" for k in range(CLASSES)}
        assert [scores[f"class{k}"] for k in range(CLASSES)] == pytest.approx(probs.tolist(), abs=1e-5)


@pytest.mark.slow
def test_push_to_hub_shares_adapter_config_posterior_and_card(tmp_path):
    import yaml

    from hub_stand_in import run_hub_worker

    hub, results = run_hub_worker("lora_hub_worker.py", tmp_path)
    files = set(hub.repos["offline-user/tiny-lora"])
    assert {"adapter_model.safetensors", "adapter_config.json", "config.json", "posterior.safetensors", "README.md",
            "tokenizer_config.json"} <= files
    assert not files & {"training_args.bin", "varsmooth_manifest.json"}
    card = hub.repos["offline-user/tiny-lora"]["README.md"].decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "offline-user/tiny-bert" and meta["library_name"] == "peft"
    assert {"lora", "base_model:adapter:offline-user/tiny-bert", "ivon"} <= set(meta["tags"])
    assert "PEFT adapter" in card and "r=4" in card and "lora_alpha=8" in card and "query" in card
    assert results["max_abs_diff_model"] < 1e-5 and results["max_abs_diff_pipeline"] < 1e-5
    assert results["loaded_is_peft"]


@pytest.mark.slow
def test_text_example_trains_minilm_adapters_that_reload(tmp_path):
    """The example end to end on the MiniLM wheel cut to one layer: adapters, posterior, reload with the cut."""
    from test_text_example import _run_example, _write_sentiment_files, needs_minilm
    from varsmooth import VariationalModel
    from varsmooth.mean_pooling_bert import MeanPoolingBertForSequenceClassification

    if needs_minilm.args[0]:
        pytest.skip(needs_minilm.kwargs["reason"])
    train, test = _write_sentiment_files(tmp_path)
    out = tmp_path / "out"
    result = _run_example("--train_file", str(train), "--test_file", str(test), "--noise_type", "none", "--max_steps",
                          "3", "--num_hidden_layers", "1", "--lora_r", "4", "--per_device_train_batch_size", "8",
                          "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    loaded = VariationalModel.from_pretrained(out)
    meta = loaded.posterior.metadata  # the settings IVON trained with: the lora preset
    assert (meta["lr"], meta["ess"], meta["clip_radius"]) == (
        LORA_PRESET["learning_rate"], LORA_PRESET["ess"], LORA_PRESET["clip_radius"])
    assert loaded.num_samples == LORA_PRESET["eval_mc_samples"] == 10  # the prediction's draws, saved with it
    base = loaded.model.get_base_model()
    assert isinstance(base, MeanPoolingBertForSequenceClassification) and len(base.bert.encoder.layer) == 1
    metrics = json.loads((out / "eval_results.json").read_text())
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0


# -- issue 33: the adapter belongs to the base weights it was trained on -----------------------------------------
def test_adapter_on_a_replaced_base_is_refused(tmp_path):
    from varsmooth import VariationalModel

    trained_adapter(tmp_path)
    out = tmp_path / "run"
    VariationalModel.from_pretrained(out)  # the base as trained on: loads
    config = BertConfig.from_pretrained(tmp_path / "base")
    torch.manual_seed(1)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "base")  # other weights, same architecture
    with pytest.raises(ValueError, match=r"The base model at .*base' holds other weights than the adapter in .* was "
                                         r"trained on"):
        VariationalModel.from_pretrained(out)


def test_adapter_whose_base_folder_was_deleted_names_it(tmp_path):
    from varsmooth import VariationalModel, pipeline

    trained_adapter(tmp_path)
    shutil.rmtree(tmp_path / "base")
    message = (r"was loaded from the folder .*base' \(base_model_name_or_path of .*adapter_config.json\), which no "
               r"longer exists. Put the base model back there, or set base_model_name_or_path")
    with pytest.raises(FileNotFoundError, match=message):
        VariationalModel.from_pretrained(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=message):
        pipeline("text-classification", model=str(tmp_path / "run"))
