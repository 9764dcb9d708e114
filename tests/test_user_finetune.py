"""Fine-tuning as Hugging Face users do it: the preset follows the model they hand the trainer, a rate in AdamW's units
is refused before the first step, and their path (from_pretrained, peft, no preset named) trains.

The preset choice is tested on tiny models; the user's path on the review sentences the examples ship, with the real
all-MiniLM-L6-v2 weights cut to 2 layers (the `pretrained` extra; skipped without it)."""

from __future__ import annotations

import logging

import datasets
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertModel

from helpers import make_args, tiny_digits_resnet
from varsmooth import VariationalTrainer, VariationalTrainingArguments
from varsmooth.adapters import add_lora_adapters
from varsmooth.presets import (
    FINETUNE_PRESET,
    LORA_PRESET,
    MIN_STEP_BOUND,
    SCRATCH_PRESET,
    choose_preset,
    newly_initialized_modules,
)

pytest.importorskip("peft")


def _tiny_bert_config() -> BertConfig:
    return BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                      max_position_embeddings=16, num_labels=2)


@pytest.fixture
def loaded_bert(tmp_path):
    """A tiny BERT saved and loaded back as a user's checkpoint is (`from_pretrained`)."""
    torch.manual_seed(0)
    BertForSequenceClassification(_tiny_bert_config()).save_pretrained(tmp_path / "checkpoint")
    return BertForSequenceClassification.from_pretrained(tmp_path / "checkpoint")


@pytest.fixture
def bert_with_new_head(tmp_path):
    """A tiny BERT encoder saved as a Hub checkpoint is and loaded with a classification head it does not have: the
    head is newly initialised (MISSING in transformers' load report), as on every user's fine-tune."""
    torch.manual_seed(0)
    BertModel(_tiny_bert_config()).save_pretrained(tmp_path / "encoder")
    return BertForSequenceClassification.from_pretrained(tmp_path / "encoder", num_labels=2)


def _tokens(n: int = 32) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 50, size=(n, 6))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "label": (ids[:, 0] > 27).astype(int).tolist()})


class _Backbone(torch.nn.Module):
    """A user's own head on a loaded backbone: no config of its own."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, input_ids, labels=None):
        return self.backbone(input_ids=input_ids)


def test_the_preset_follows_the_model(loaded_bert, tmp_path) -> None:
    assert choose_preset(loaded_bert)[0] == "finetune"
    # the folder's last two components: its place on this machine means nothing to a reader of the card
    assert f"'…/{tmp_path.name}/checkpoint'" in choose_preset(loaded_bert)[1]
    assert choose_preset(_Backbone(loaded_bert))[0] == "finetune"  # a loaded submodule counts
    assert choose_preset(add_lora_adapters(loaded_bert, r=2, alpha=4))[0] == "lora"
    assert choose_preset(BertForSequenceClassification(_tiny_bert_config()))[0] == "scratch"  # built from a config
    assert choose_preset(tiny_digits_resnet())[0] == "scratch"
    assert choose_preset(torch.nn.Linear(2, 2))[0] == "scratch"


def test_the_trainer_chooses_the_preset_says_why_and_leaves_the_arguments_as_given(loaded_bert, tmp_path, caplog):
    args = make_args(tmp_path / "out", max_steps=1)
    assert args.method_config.ivon_preset is None and args.learning_rate is None and args.eval_mc_samples is None
    with caplog.at_level(logging.INFO, logger="varsmooth"):
        trainer = VariationalTrainer(model=loaded_bert, args=args, train_dataset=_tokens())
    choices = [r.getMessage() for r in caplog.records if "chosen because" in r.getMessage()]
    assert len(choices) == 1 and "finetune" in choices[0] and "checkpoint" in choices[0]
    assert trainer.args.method_config.ivon_preset == "finetune"
    assert trainer.args.learning_rate == FINETUNE_PRESET["learning_rate"]
    assert trainer.args.method_config.hess_init == FINETUNE_PRESET["hess_init"]
    assert trainer.args.eval_mc_samples == SCRATCH_PRESET["eval_mc_samples"]
    # the caller's arguments still choose from the model: a trainer of another model gets its own preset
    assert args.method_config.ivon_preset is None and args.learning_rate is None
    scratch = VariationalTrainer(model=BertForSequenceClassification(_tiny_bert_config()), args=args,
                                 train_dataset=_tokens())
    assert scratch.args.method_config.ivon_preset == "scratch" and scratch.args.learning_rate == 0.2
    # the run record (the model card's source) and the method's settings name the choice
    record = trainer.run_record()
    assert record.hyperparameters["ivon_preset"] == "finetune"
    assert "chosen because its weights were loaded from" in record.method_config_choice


def test_the_weights_from_pretrained_initialised_are_told_from_the_loaded_ones(bert_with_new_head, loaded_bert,
                                                                             tmp_path) -> None:
    assert newly_initialized_modules(bert_with_new_head) == ["classifier"]
    assert newly_initialized_modules(loaded_bert) == []  # its checkpoint had the head
    # a head of another size (ignore_mismatched_sizes) is new too
    other = BertForSequenceClassification.from_pretrained(tmp_path / "checkpoint", num_labels=3,
                                                          ignore_mismatched_sizes=True)
    assert newly_initialized_modules(other) == ["classifier"]
    # nothing transformers loaded: no mark tells a loaded weight from a new one
    assert newly_initialized_modules(BertForSequenceClassification(_tiny_bert_config())) is None
    assert newly_initialized_modules(tiny_digits_resnet()) is None


def _weight_steps(trainer: VariationalTrainer, before: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest move of a weight in the head and in the rest of the model since `before`."""
    moved = {name: (p.detach() - before[name]).abs().max().item() for name, p in trainer.model.named_parameters()}
    return {"head": max(v for k, v in moved.items() if k.startswith("classifier.")),
            "rest": max(v for k, v in moved.items() if not k.startswith("classifier."))}


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_the_new_head_moves_its_multiple_of_the_sign_step(bert_with_new_head, tmp_path, scale) -> None:
    """Under the finetune preset h0 is far below the gradients, so the clipped update moves every weight by exactly
    lr·clip_radius in the first step (a sign step): the head by `scale` times that."""
    before = {name: p.detach().clone() for name, p in bert_with_new_head.named_parameters()}
    args = make_args(tmp_path / "out", ivon_preset="finetune", new_weight_lr_scale=scale, max_steps=1)
    trainer = VariationalTrainer(model=bert_with_new_head, args=args, train_dataset=_tokens())
    trainer.train()
    bound = FINETUNE_PRESET["learning_rate"] * FINETUNE_PRESET["clip_radius"]
    steps = _weight_steps(trainer, before)
    # float32 weights of size ~1 (LayerNorm's) store a step of 2e-5 to within an ulp, 1.2e-7
    assert steps["rest"] == pytest.approx(bound, rel=1e-2)
    assert steps["head"] == pytest.approx(scale * bound, rel=1e-2)
    groups = trainer.optimizer.param_groups
    assert len(groups) == (1 if scale == 1 else 2)
    if scale != 1:
        assert trainer.args.method_config.new_weight_modules == ["classifier"]
        assert "the weights from_pretrained newly initialised (classifier) train at 10× the rate" in (
            trainer.method_config_choice)
        assert trainer.run_record().hyperparameters["new_weight_modules"] == ["classifier"]
        # the scheduler scales each group's own rate: the head's stays 10× the rest's
        assert groups[1]["lr"] == pytest.approx(scale * groups[0]["lr"])


def test_named_new_weight_modules_win_and_frozen_means_win_over_them(bert_with_new_head, tmp_path) -> None:
    before = {name: p.detach().clone() for name, p in bert_with_new_head.named_parameters()}
    trainer = VariationalTrainer(model=bert_with_new_head, train_dataset=_tokens(), args=make_args(
        tmp_path / "out", ivon_preset="finetune", new_weight_lr_scale=10.0, new_weight_modules=["pooler.dense"],
        frozen_mean_modules=["classifier"], max_steps=1))
    trainer.train()
    moved = {name: (p.detach() - before[name]).abs().max().item()
             for name, p in trainer.model.named_parameters()}
    bound = FINETUNE_PRESET["learning_rate"] * FINETUNE_PRESET["clip_radius"]
    assert moved["bert.pooler.dense.weight"] == pytest.approx(10 * bound, rel=1e-2)
    assert moved["classifier.weight"] == 0.0
    with pytest.raises(ValueError, match=r"new_weight_modules names \['head'\], which match no module"):
        VariationalTrainer(model=bert_with_new_head, train_dataset=_tokens(), args=make_args(
            tmp_path / "bad", ivon_preset="finetune", new_weight_lr_scale=10.0, new_weight_modules=["head"],
            max_steps=1)).train()
    with pytest.raises(ValueError, match="new_weight_lr_scale multiplies the learning rate"):
        make_args(tmp_path / "zero", new_weight_lr_scale=0.0)


def test_a_model_transformers_did_not_load_trains_every_weight_at_one_rate_and_says_so(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="varsmooth"):
        trainer = VariationalTrainer(model=BertForSequenceClassification(_tiny_bert_config()), train_dataset=_tokens(),
                                     args=make_args(tmp_path / "out", ivon_preset="finetune", new_weight_lr_scale=10.0,
                                                    max_steps=1))
    assert any("new_weight_lr_scale=10, but no weight" in r.getMessage() and "new_weight_modules" in r.getMessage()
               for r in caplog.records)
    assert trainer.args.method_config.new_weight_modules == []
    assert "newly initialised" not in trainer.method_config_choice
    trainer.train()
    assert len(trainer.optimizer.param_groups) == 1


@pytest.mark.slow
def test_the_card_says_which_preset_and_why(loaded_bert, tmp_path) -> None:
    trainer = VariationalTrainer(model=loaded_bert, args=make_args(tmp_path / "out", max_steps=1),
                                 train_dataset=_tokens())
    trainer.train()
    trainer.save_model()
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| ivon_preset | finetune |" in card
    assert "Settings: ivon_preset='finetune', chosen because its weights were loaded from" in card


def test_a_named_preset_wins_and_scratch_on_a_loaded_model_warns(loaded_bert, tmp_path, caplog) -> None:
    lora = VariationalTrainer(model=loaded_bert, args=make_args(tmp_path / "a", ivon_preset="lora", max_steps=1),
                              train_dataset=_tokens())
    assert lora.args.method_config.ivon_preset == "lora" and lora.args.learning_rate == LORA_PRESET["learning_rate"]
    assert lora.method_config_choice == "ivon_preset='lora', as given"
    with caplog.at_level(logging.WARNING, logger="varsmooth"):
        VariationalTrainer(model=loaded_bert, args=make_args(tmp_path / "b", ivon_preset="scratch", max_steps=1),
                           train_dataset=_tokens())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ivon_preset='scratch' given" in w and "'finetune' is chosen" in w for w in warnings)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="varsmooth"):  # scratch on a model built from a config: no warning
        VariationalTrainer(model=BertForSequenceClassification(_tiny_bert_config()),
                           args=make_args(tmp_path / "c", ivon_preset="scratch", max_steps=1), train_dataset=_tokens())
    assert not [r for r in caplog.records if "ivon_preset='scratch' given" in r.getMessage()]


def test_peft_adapters_take_the_lora_preset(loaded_bert, tmp_path) -> None:
    trainer = VariationalTrainer(model=add_lora_adapters(loaded_bert, r=2, alpha=4),
                                 args=make_args(tmp_path / "out", max_steps=1), train_dataset=_tokens())
    assert trainer.args.method_config.ivon_preset == "lora"
    assert trainer.args.eval_mc_samples == LORA_PRESET["eval_mc_samples"]


@pytest.mark.parametrize("rate", [2e-5, 5e-5])
def test_an_adamw_rate_under_a_clipped_preset_is_refused_before_the_first_step(loaded_bert, tmp_path, rate) -> None:
    before = {k: v.clone() for k, v in loaded_bert.state_dict().items()}
    trainer = VariationalTrainer(model=loaded_bert, args=make_args(tmp_path / "out", learning_rate=rate, max_steps=2),
                                 train_dataset=_tokens())
    with pytest.raises(ValueError, match=rf"learning_rate={rate:g} looks like an AdamW rate.*"
                                         rf"{rate * 1e-3:.1e} a step.*Leave learning_rate unset for the 'finetune' "
                                         rf"preset's {FINETUNE_PRESET['learning_rate']:g}"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in loaded_bert.state_dict().items())
    # the bound itself is accepted
    ok = VariationalTrainer(model=loaded_bert, args=make_args(tmp_path / "ok", max_steps=1,
                                                              learning_rate=MIN_STEP_BOUND / 1e-3),
                            train_dataset=_tokens())
    ok.train()
    assert ok.state.global_step == 1


# -- the user's path, end to end ----------------------------------------------------------------------------------
def _minilm_path():
    from example_utils.models import minilm_path

    path = minilm_path()
    if path is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (the `pretrained` extra)")
    return path


def _reviews(tokenizer, n_train: int, n_test: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    from example_utils.data import load_sentiment_sentences

    data = load_sentiment_sentences(seed=0)
    encode = lambda b: tokenizer(b["text"], truncation=True, max_length=48)  # noqa: E731
    train = data["train"].select(range(n_train)).map(encode, batched=True).remove_columns(["text", "source"])
    test = data["test"].select(range(n_test)).map(encode, batched=True).remove_columns(["text", "source"])
    return train, test


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_users_path_fine_tunes_with_the_preset_chosen_for_it(tmp_path, lora) -> None:
    """`from_pretrained` (and peft on top), `VariationalTrainingArguments` with nothing IVON-specific: the preset is
    chosen from the model and the run beats chance by a margin the former finetune default (lr 0.3, a step bound
    of 3e-4 that left this model at 51.7 %, chance, on the full task) and the scratch preset do not reach."""
    import peft
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    path = _minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, test = _reviews(tokenizer, 480, 200)
    torch.manual_seed(0)
    # all 6 layers: the checkpoint's [CLS] pooler was never trained (sentence-transformers pool by the mean), and
    # after 2 layers [CLS] hardly depends on the sentence (a run there ends at chance or not by the float path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16,
                                                           target_modules=["query", "value"]))
    args = VariationalTrainingArguments(output_dir=str(tmp_path), num_train_epochs=3, per_device_train_batch_size=8,
                                        eval_mc_samples=4, use_cpu=True, report_to=[], save_strategy="no",
                                        disable_tqdm=True, seed=0)
    trainer = VariationalTrainer(model=model, args=args, train_dataset=train, eval_dataset=test,
                                 data_collator=DataCollatorWithPadding(tokenizer))
    assert trainer.args.method_config.ivon_preset == ("lora" if lora else "finetune")
    trainer.train()
    accuracy = trainer.evaluate()["eval_accuracy"]
    assert accuracy > 0.7, accuracy  # chance is 0.5 (the test split is balanced)

