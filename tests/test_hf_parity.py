"""The HF parity suite: what transformers' documentation teaches for `Trainer`, run through `VariationalTrainer` with
IVON and with method='erm', on a tiny model, against the stock `Trainer` where it can do the same (issue 41).

A transformers release that adds a `TrainingArguments` field, or changes one of these recipes, fails here."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, Trainer, TrainerCallback, TrainingArguments
from transformers.modeling_outputs import SequenceClassifierOutput

from helpers import TinyClassifier, digits_dataset, make_args
from varsmooth import VariationalTrainer
from varsmooth.trainer.arguments import HONOURED_ARGUMENTS, UNHONOURED_ARGUMENTS, check_unhonoured_arguments

METHODS = ("ivon", "erm")
#: a value other than TrainingArguments' default for each field of UNHONOURED_ARGUMENTS
UNHONOURED_VALUES = {
    "optim": "adamw_torch", "optim_args": "momentum=0.9", "optim_target_modules": ["body"], "adam_beta1": 0.8,
    "adam_beta2": 0.99, "adam_epsilon": 1e-6, "weight_decay": 0.01, "fp16": True, "deepspeed": "ds_config.json",
    "label_smoothing_factor": 0.1, "average_tokens_across_devices": False,
}


class LossTinyClassifier(TinyClassifier):
    """`TinyClassifier` computing its own cross-entropy, from `labels` or `target`, as HF models do for the stock
    Trainer (varsmooth never passes the labels to the model)."""

    def forward(self, pixel_values, labels=None, target=None):
        out = super().forward(pixel_values)
        labels = labels if labels is not None else target
        return SequenceClassifierOutput(loss=None if labels is None else F.cross_entropy(out.logits, labels),
                                        logits=out.logits)


def _model(seed: int = 0) -> LossTinyClassifier:
    torch.manual_seed(seed)
    return LossTinyClassifier()


def _args(tmp_path, method: str, **kw):
    defaults = dict(max_steps=4, eval_mc_samples=4, learning_rate=0.05 if method == "erm" else None)
    return make_args(tmp_path, method=method, **{**defaults, **kw})


def _stock_args(tmp_path, **kw) -> TrainingArguments:
    defaults = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                    disable_tqdm=True, per_device_train_batch_size=16, per_device_eval_batch_size=64, seed=0,
                    max_grad_norm=0.0, max_steps=4, learning_rate=0.05)
    return TrainingArguments(**{**defaults, **kw})


# -- TrainingArguments: every field honoured, or refused / ignored with a reason ------------------------------------
def test_every_training_argument_is_classified():
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert not HONOURED_ARGUMENTS & set(UNHONOURED_ARGUMENTS)
    assert fields - HONOURED_ARGUMENTS - set(UNHONOURED_ARGUMENTS) == set(), \
        ("new TrainingArguments fields: add each to HONOURED_ARGUMENTS or UNHONOURED_ARGUMENTS "
         "(varsmooth.trainer.checks)")
    assert (HONOURED_ARGUMENTS | set(UNHONOURED_ARGUMENTS)) - fields == set(), "fields transformers no longer has"
    assert set(UNHONOURED_VALUES) == set(UNHONOURED_ARGUMENTS)


@pytest.mark.parametrize("method", METHODS)
def test_unhonoured_arguments_are_refused_or_warned(tmp_path, method, caplog):
    args = _args(tmp_path, method)
    for name, (methods, action, _) in UNHONOURED_ARGUMENTS.items():
        default = getattr(args, name)
        setattr(args, name, UNHONOURED_VALUES[name])
        caplog.clear()
        applies = methods == "all" or method == "ivon"
        if applies and action == "refuse":
            with pytest.raises(ValueError, match=f"{name}="):
                check_unhonoured_arguments(args)
        else:
            with caplog.at_level(logging.WARNING, logger="varsmooth.trainer.checks"):
                check_unhonoured_arguments(args)
            assert (f"{name}=" in caplog.text) == (applies and action == "ignore")
        setattr(args, name, default)


def test_optim_is_refused_with_ivon_and_built_as_the_stock_trainer_does_with_erm(tmp_path):
    with pytest.raises(ValueError, match=r"optim='sgd'.*method='erm'"):
        VariationalTrainer(model=_model(), args=_args(tmp_path, "ivon", optim="sgd"))
    ours = VariationalTrainer(model=_model(), args=_args(tmp_path, "erm", optim="sgd")).create_optimizer()
    stock = Trainer(model=_model(), args=_stock_args(tmp_path, optim="sgd")).create_optimizer()
    assert type(ours) is type(stock) is torch.optim.SGD
    assert ours.param_groups[0]["lr"] == stock.param_groups[0]["lr"] == 0.05


# -- hyperparameter_search ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method, searched", [("ivon", {"learning_rate": (0.01, 0.3), "prior_precision": (1e-4, 1e-2)}),
                                              ("erm", {"learning_rate": (1e-3, 0.1)}),
                                              ("ls", {"learning_rate": (1e-3, 0.1), "smoothing": (0.05, 0.5)})])
def test_hyperparameter_search_trials_reach_the_optimizer_and_the_method(tmp_path, method, searched):
    pytest.importorskip("optuna")
    suggested, seen, losses = [], [], []

    def hp_space(trial):
        suggested.append({k: trial.suggest_float(k, *bounds, log=True) for k, bounds in searched.items()})
        return suggested[-1]

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            group = optimizer.param_groups[0]
            seen.append({"learning_rate": group["lr"], "prior_precision": group.get("weight_decay"),
                         "smoothing": getattr(trainer.method.config, "smoothing", None)})

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            losses.append(metrics["eval_loss"])

    train, val = digits_dataset(64), digits_dataset(64, seed=1)
    trainer = VariationalTrainer(model_init=lambda: _model(),
                                 args=_args(tmp_path, method, lr_scheduler_type="constant"),
                                 train_dataset=train, eval_dataset=val, callbacks=[Record()])
    best = trainer.hyperparameter_search(hp_space=hp_space, backend="optuna", n_trials=2, direction="minimize")
    assert len(suggested) == len(seen) == 2 and suggested[0] != suggested[1]
    for trial, used in zip(suggested, seen):
        assert {k: used[k] for k in trial} == pytest.approx(trial)
    # HF's default objective: the evaluation loss, not a sum over the metrics varsmooth adds
    assert best.objective == pytest.approx(min(losses))


def test_default_objective_is_the_stock_trainers(tmp_path):
    """The evaluation loss without compute_metrics; the sum of the user's metrics with it (HF's rule), never of
    varsmooth's own."""
    trainer = VariationalTrainer(model=_model(), args=_args(tmp_path, "erm"), eval_dataset=digits_dataset(64),
                                 compute_metrics=lambda p: {"mine": 0.25})
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] > 0 and metrics["eval_mine"] == 0.25
    assert trainer.default_objective(metrics) == 0.25
    trainer = VariationalTrainer(model=_model(), args=_args(tmp_path, "erm"), eval_dataset=digits_dataset(64))
    metrics = trainer.evaluate()
    assert trainer.default_objective(metrics) == metrics["eval_loss"]


def test_a_search_cannot_change_the_method(tmp_path):
    pytest.importorskip("optuna")
    trainer = VariationalTrainer(model_init=lambda: _model(), args=_args(tmp_path, "erm"),
                                 train_dataset=digits_dataset(32))
    with pytest.raises(ValueError, match="fixed for a search"):
        trainer.hyperparameter_search(hp_space=lambda t: {"method": t.suggest_categorical("method", ["ls"])},
                                      backend="optuna", n_trials=1)


# -- labels, metrics and losses as HF users write them --------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_label_names_name_the_label_column_in_training_and_evaluation(tmp_path, method):
    """label_names=['target'] trains and evaluates exactly as the same data under 'label'."""
    results = []
    for column, label_names in (("label", None), ("target", ["target"])):
        train, val = (d if column == "label" else d.rename_column("label", column)
                      for d in (digits_dataset(64), digits_dataset(64, seed=1)))
        trainer = VariationalTrainer(model=_model(), args=_args(tmp_path / column, method, label_names=label_names),
                                     train_dataset=train, eval_dataset=val)
        trainer.train()
        results.append(trainer.evaluate())
    assert "eval_loss" in results[1] and "eval_accuracy" in results[1]
    assert results[1]["eval_loss"] == pytest.approx(results[0]["eval_loss"])
    assert results[1]["eval_accuracy"] == results[0]["eval_accuracy"]


def test_more_than_one_label_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="label_names=\\['a', 'b'\\]"):
        VariationalTrainer(model=_model(), args=_args(tmp_path, "ivon", label_names=["a", "b"]))


def _accuracy(eval_pred):
    return {"acc": float((np.asarray(eval_pred.predictions) == eval_pred.label_ids).mean())}


def test_preprocess_logits_for_metrics_and_compute_metrics_get_logits_as_with_the_stock_trainer(tmp_path):
    """`lambda logits, labels: logits.argmax(-1)`: the same predictions and metrics as the stock Trainer (ERM predicts
    at the weights); softmax of what compute_metrics gets is the predicted distribution."""
    val = digits_dataset(64, seed=1)
    argmax = lambda logits, labels: logits.argmax(-1)  # noqa: E731
    stock = Trainer(model=_model(), args=_stock_args(tmp_path), eval_dataset=val, compute_metrics=_accuracy,
                    preprocess_logits_for_metrics=argmax)
    ours = VariationalTrainer(model=_model(), args=_args(tmp_path, "erm"), eval_dataset=val, compute_metrics=_accuracy,
                              preprocess_logits_for_metrics=argmax)
    assert ours.evaluate()["eval_acc"] == stock.evaluate()["eval_acc"]
    np.testing.assert_array_equal(ours.predict(val).predictions, stock.predict(val).predictions)

    seen = {}
    ivon = VariationalTrainer(model=_model(), args=_args(tmp_path, "ivon"), train_dataset=digits_dataset(64),
                              eval_dataset=val, compute_metrics=lambda p: seen.update(logits=p.predictions) or {})
    ivon.train()
    metrics = ivon.evaluate()
    probs = torch.as_tensor(seen["logits"]).softmax(-1).numpy()
    np.testing.assert_allclose(probs, np.exp(seen["logits"]), rtol=1e-5, atol=1e-7)
    assert metrics["eval_accuracy"] == pytest.approx((probs.argmax(-1) == np.asarray(val["label"])).mean())
    preprocessed = VariationalTrainer(model=ivon.model, args=_args(tmp_path, "ivon"), eval_dataset=val,
                                      posterior=ivon.posterior_predictor(), compute_metrics=_accuracy,
                                      preprocess_logits_for_metrics=argmax)
    assert preprocessed.evaluate()["eval_acc"] == pytest.approx(metrics["eval_accuracy"])
    np.testing.assert_array_equal(preprocessed.predict(val).predictions, seen["logits"].argmax(-1))


@pytest.mark.parametrize("method", METHODS)
def test_eval_do_concat_batches_false_gives_batches_as_the_stock_trainer(tmp_path, method):
    """compute_metrics gets a list of per-batch predictions as from the stock Trainer; varsmooth's own metrics are
    those of the concatenated evaluation."""
    val = digits_dataset(40, seed=1)

    def shapes(eval_pred):
        return {"batches": len(eval_pred.predictions), "rows": sum(len(b) for b in eval_pred.predictions)}

    stock = Trainer(model=_model(),
                    args=_stock_args(tmp_path, eval_do_concat_batches=False, per_device_eval_batch_size=16),
                    eval_dataset=val, compute_metrics=shapes).evaluate()
    ours = VariationalTrainer(model=_model(), eval_dataset=val, compute_metrics=shapes, args=_args(
        tmp_path, method, eval_do_concat_batches=False, per_device_eval_batch_size=16)).evaluate()
    concatenated = VariationalTrainer(model=_model(), args=_args(tmp_path, method, per_device_eval_batch_size=16),
                                      eval_dataset=val).evaluate()
    assert (ours["eval_batches"], ours["eval_rows"]) == (stock["eval_batches"], stock["eval_rows"]) == (3, 40)
    scores = [k for k in concatenated if not k.endswith(("_runtime", "_per_second", "_time"))]
    assert {k: ours[k] for k in scores} == pytest.approx({k: concatenated[k] for k in scores})


@pytest.mark.parametrize("method", METHODS)
def test_compute_loss_func_as_hf_documents_it(tmp_path, method):
    """`sum / num_items_in_batch` gets the labelled examples of the micro-batch: the run equals one without the
    function (cross-entropy, the mean), and for ERM the stock Trainer's with the same function."""
    counts = []

    def loss_func(outputs, labels, num_items_in_batch):
        counts.append(int(num_items_in_batch))
        return F.cross_entropy(outputs.logits, labels, reduction="sum") / num_items_in_batch

    train = digits_dataset(40)
    trained = []
    for func in (loss_func, None):
        trainer = VariationalTrainer(model=_model(), args=_args(tmp_path, method), train_dataset=train,
                                     compute_loss_func=func)
        trainer.train()
        trained.append(trainer.model)
    assert counts == [16, 16, 8, 16]  # 40 examples in batches of 16, 4 steps
    for a, b in zip(trained[0].parameters(), trained[1].parameters()):
        torch.testing.assert_close(a, b)
    if method == "erm":
        stock = Trainer(model=_model(), args=_stock_args(tmp_path), train_dataset=train, compute_loss_func=loss_func)
        stock.train()
        for a, b in zip(trained[0].parameters(), stock.model.parameters()):
            torch.testing.assert_close(a, b)


def _configured(**config) -> LossTinyClassifier:
    model = _model()
    model.config = PretrainedConfig(**config)
    return model


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("config, named",
                         [({"problem_type": "multi_label_classification", "num_labels": 10}, "multi_label"),
                                           ({"num_labels": 1}, "regression")])
def test_multi_label_and_regression_models_are_refused_up_front(tmp_path, method, config, named):
    with pytest.raises(ValueError, match=named):
        VariationalTrainer(model=_configured(**config), args=_args(tmp_path, method))
    with pytest.raises(ValueError, match=named):  # model_init: refused when the trainer builds the model
        VariationalTrainer(model_init=lambda: _configured(**config), args=_args(tmp_path, method))


# -- load_best_model_at_end --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_best_metric_is_what_the_loaded_best_model_gives(tmp_path, method):
    args = _args(tmp_path, method, max_steps=6, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                 save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss")
    trainer = VariationalTrainer(model=_model(), args=args, train_dataset=digits_dataset(64),
                                 eval_dataset=digits_dataset(64, seed=1))
    trainer.train()
    assert trainer.posterior_temperature.value == 1.0  # the τ the evaluations during training used: not chosen again
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trainer.state.best_metric)


# -- pipelines ---------------------------------------------------------------------------------------------------------
def test_image_and_text_pipelines_answer_the_uncertainty_in_one_shape(tmp_path):
    """One input: one dict whose "predictions" is a list of {label, score} (the stock pipeline's answer, the text
    pipeline's top label in a list as it returns it); a list of inputs: a list of those dicts."""
    from transformers import ViTImageProcessor

    from example_utils.models import create_text_classifier
    from helpers import tiny_digits_resnet
    from varsmooth import DiagonalGaussianPosterior, VariationalModel, pipeline

    def save(model, folder):
        posterior = DiagonalGaussianPosterior(model, {n: torch.full_like(p, 0.02) for n, p in model.named_parameters()})
        VariationalModel(model, posterior, num_samples=2).save_pretrained(folder)

    save(tiny_digits_resnet(), tmp_path / "image")
    ViTImageProcessor(do_resize=False, image_mean=[0.5], image_std=[0.5],
                      do_convert_rgb=False).save_pretrained(tmp_path / "image")
    text_model, tokenizer = create_text_classifier(None, {0: "neg", 1: "pos"},
                                                   train_texts=["a good film", "a bad film"])
    save(text_model, tmp_path / "text")
    tokenizer.save_pretrained(tmp_path / "text")
    image = (np.random.default_rng(0).random((8, 8)) * 255).astype("uint8")
    for task, x in (("image-classification", image), ("text-classification", "a good film")):
        classify = pipeline(task, model=str(tmp_path / task.split("-")[0]))
        one = classify(x, return_uncertainty=True)
        assert set(one) == {"predictions", "entropy", "expected_entropy", "mutual_information",
                            "uncertainty_temperature"}, task
        stock = classify(x)  # without the uncertainty: the stock pipeline's answer
        assert [p["label"] for p in one["predictions"]] == [p["label"] for p in stock]
        assert [p["score"] for p in one["predictions"]] == pytest.approx([p["score"] for p in stock])
        assert isinstance(one["predictions"], list) and all(set(p) == {"label", "score"} for p in one["predictions"])
        assert classify([x, x], return_uncertainty=True) == [one, one]
