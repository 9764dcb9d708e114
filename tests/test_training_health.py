"""A run whose training loss barely fell below ln K (a uniform prediction's) warns, and its model card says so."""

import logging
import math

import pytest

from helpers import digits_images, make_args, tiny_digits_resnet
from varsmooth import VariationalTrainer
from varsmooth.training_health import STALLED_LOSS_SHARE, stalled_training_loss


def test_a_last_loss_near_ln_k_is_stalled_and_one_below_it_is_not():
    # the lora preset's former 0.03 on a 4-class task: 1.365 against ln 4 = 1.386
    stalled = stalled_training_loss([{"loss": 2.0, "step": 10}, {"loss": 1.365, "step": 189}], 4)
    assert stalled == {"loss": 1.365, "step": 189, "uniform_loss": pytest.approx(math.log(4)),
                       "what": "its last logged value"}
    # 30 % flipped binary labels: a trained model ends near the labels' entropy, 0.61 = 0.88 ln 2
    assert stalled_training_loss([{"loss": 0.61, "step": 100}], 2) is None
    assert stalled_training_loss([{"loss": STALLED_LOSS_SHARE * math.log(10) - 1e-6}], 10) is None


def test_the_run_mean_counts_too_and_without_k_nothing_is_said():
    assert stalled_training_loss([{"train_loss": 2.25, "step": 5}], 10)["what"] == "its mean over the run"
    # the text example with ivon_smoothing: a noisy last window at 0.96 ln 2, a run mean at 0.89 ln 2, 81 % accuracy
    assert stalled_training_loss([{"loss": 0.6657, "step": 50}, {"train_loss": 0.6135, "step": 96}], 2) is None
    stalled = stalled_training_loss([{"loss": 2.26, "step": 50}, {"train_loss": 2.28, "step": 96}], 10)
    assert (stalled["loss"], stalled["what"]) == (2.26, "its last logged value")
    assert stalled_training_loss([{"loss": 5.0}], None) is None and stalled_training_loss([], 10) is None


@pytest.mark.parametrize("method,lr,stalls", [("erm", 1e-9, True), ("erm", 3e-3, False), ("ls", 1e-9, False)])
def test_the_trainer_warns_and_the_card_says_so_only_when_the_cross_entropy_stalled(tmp_path, caplog, method, lr,
                                                                                    stalls):
    args = make_args(tmp_path, method=method, learning_rate=lr, num_train_epochs=3, logging_steps=10)
    trainer = VariationalTrainer(model=tiny_digits_resnet(), args=args, train_dataset=digits_images(400))
    with caplog.at_level(logging.WARNING, logger="varsmooth.training_health"):
        trainer.train()
    warned = [r for r in caplog.records if "training loss barely fell" in r.getMessage()]
    assert bool(warned) == stalls  # label smoothing's loss has another floor than ln K: not judged
    trainer.save_model()
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert ("**Warning.** The training loss barely fell" in card) == stalls
