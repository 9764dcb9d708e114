"""Statistical and API tests of varsmooth.corruption (reference values: the noise models' definitions, computed
here)."""

from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, List, Value
from transformers import HfArgumentParser

from varsmooth.corruption import (
    ASYMMETRIC_CLASS_MAPS,
    NOISE_TYPES,
    CorruptionArguments,
    NoiseReport,
    corrupt_labels,
    noise_report,
)
from varsmooth.corruption.transition import asymmetric_transition, symmetric_transition, uniform_transition

K = 10
CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def balanced(n: int = 5000, num_classes: int = K, names: list[str] | None = None) -> Dataset:
    label = ClassLabel(names=names) if names else ClassLabel(num_classes=num_classes)
    return Dataset.from_dict(
        {"id": np.arange(n), "label": np.arange(n) % num_classes},
        features=Features({"id": Value("int64"), "label": label}),
    )


def labels_of(ds: Dataset, column: str = "label") -> np.ndarray:
    return np.asarray(ds.with_format("numpy", columns=[column])[:][column])


def assert_rate_close(realized: float, expected: float, n: int) -> None:
    se = np.sqrt(expected * (1 - expected) / n)
    assert abs(realized - expected) <= 4 * se + 1e-12, (realized, expected, se)


def assert_rows_close(report: NoiseReport, slack: float = 0.005) -> None:
    T = np.asarray(report.intended_transition)
    T_hat = np.asarray(report.realized_transition)
    n = np.asarray(report.class_counts)[:, None]
    bound = 4 * np.sqrt(T * (1 - T) / n) + slack
    assert np.all(np.abs(T_hat - T) <= bound), np.abs(T_hat - T).max()


# ---------------------------------------------------------------------------------------------- noise types


@pytest.mark.parametrize("rate", [0.2, 0.5])
def test_symmetric_flips_to_other_classes_at_rate(rate):
    ds = balanced()
    out, report = corrupt_labels(ds, "symmetric", rate, seed=0, return_report=True)
    clean, noisy, flagged = labels_of(out, "clean_label"), labels_of(out), labels_of(out, "is_corrupted")
    np.testing.assert_array_equal(flagged, noisy != clean)
    # "flip to a different class" convention: realized rate ≈ rate, not rate (K-1)/K
    assert_rate_close(flagged.mean(), rate, len(ds))
    assert report.realized_rate == flagged.mean()
    assert report.intended_rate == pytest.approx(rate)
    T = np.asarray(report.intended_transition)
    assert T[0, 0] == pytest.approx(1 - rate) and T[0, 1] == pytest.approx(rate / (K - 1))
    assert_rows_close(report)


def test_uniform_resamples_over_all_classes():
    rate = 0.4
    out, report = corrupt_labels(balanced(), "uniform", rate, seed=0, return_report=True)
    expected = rate * (K - 1) / K  # selected examples that redraw their own class stay clean
    assert report.intended_rate == pytest.approx(expected)
    assert_rate_close(labels_of(out, "is_corrupted").mean(), expected, len(out))
    assert np.diag(report.intended_transition) == pytest.approx(1 - rate + rate / K)
    assert_rows_close(report)


def test_pairflip_goes_only_to_next_class():
    out, report = corrupt_labels(balanced(), "pairflip", 0.45, seed=0, return_report=True)
    clean, noisy = labels_of(out, "clean_label"), labels_of(out)
    changed = noisy != clean
    np.testing.assert_array_equal(noisy[changed], (clean[changed] + 1) % K)  # 9 -> 0 included
    assert_rate_close(changed.mean(), 0.45, len(out))
    assert_rows_close(report)


def test_asymmetric_cifar10_map():
    rate = 0.4
    ds = balanced(names=CIFAR10_NAMES)
    out, report = corrupt_labels(ds, "asymmetric", rate, seed=0, class_map="cifar10", return_report=True)
    clean, noisy = labels_of(out, "clean_label"), labels_of(out)
    cifar10 = ASYMMETRIC_CLASS_MAPS["cifar10"]
    assert cifar10[9] == 1  # truck -> automobile, present in both reference codes
    for c in range(K):
        members = clean == c
        if c in cifar10:
            assert set(noisy[members]) == {c, cifar10[c]}
            assert_rate_close((noisy[members] != c).mean(), rate, members.sum())
        else:
            np.testing.assert_array_equal(noisy[members], c)
    # five of ten classes flip: overall 0.20
    assert report.intended_rate == pytest.approx(rate / 2)
    assert_rate_close(report.realized_rate, rate / 2, len(out))
    assert_rows_close(report)


def test_asymmetric_named_and_user_maps():
    ds = balanced(names=CIFAR10_NAMES)
    by_name = corrupt_labels(ds, "asymmetric", 0.3, seed=1, class_map={"truck": "automobile", "cat": "dog"})
    by_index = corrupt_labels(ds, "asymmetric", 0.3, seed=1, class_map={9: 1, 3: 5})
    by_json_keys = corrupt_labels(ds, "asymmetric", 0.3, seed=1, class_map={"9": 1, "3": "5"})
    np.testing.assert_array_equal(labels_of(by_name), labels_of(by_index))
    np.testing.assert_array_equal(labels_of(by_name), labels_of(by_json_keys))
    mnist = corrupt_labels(balanced(), "asymmetric", 1.0, seed=0, class_map="mnist")
    clean, noisy = labels_of(mnist, "clean_label"), labels_of(mnist)
    for source, target in {7: 1, 2: 7, 5: 6, 6: 5, 3: 8}.items():
        np.testing.assert_array_equal(noisy[clean == source], target)
    np.testing.assert_array_equal(noisy[np.isin(clean, [0, 1, 4, 8, 9])], clean[np.isin(clean, [0, 1, 4, 8, 9])])
    cifar100 = corrupt_labels(balanced(2000, 100), "asymmetric", 1.0, seed=0, class_map="cifar100")
    np.testing.assert_array_equal(labels_of(cifar100), (labels_of(cifar100, "clean_label") + 1) % 100)


def test_classwise_seed000_eq20_21():
    kappa, beta, n = 0.1, 0.05, 20000
    out, report = corrupt_labels(balanced(n), "classwise", seed=0, kappa=kappa, beta=beta, return_report=True)
    i = np.arange(1, K + 1)  # the paper's 1-based class number
    T = np.asarray(report.intended_transition)
    np.testing.assert_allclose(np.diag(T), 1 - (kappa + beta * i))
    np.testing.assert_allclose(T[0, 1:], (kappa + beta) / (K - 1))
    per_class = np.asarray(report.per_class_rate)
    assert np.all(np.diff(per_class) > 0)
    for c in range(K):
        assert_rate_close(per_class[c], kappa + beta * (c + 1), n // K)
    assert report.intended_rate == pytest.approx(kappa + beta * (K + 1) / 2)  # 0.375
    assert_rate_close(report.realized_rate, kappa + beta * (K + 1) / 2, n)
    assert_rows_close(report)
    assert report.params == {"kappa": kappa, "beta": beta}


def test_classwise_boundary_fully_flips_last_class():
    out, report = corrupt_labels(balanced(1000), "classwise", seed=0, kappa=0.5, return_report=True)
    assert report.per_class_rate[-1] == 1.0  # kappa + beta K = 1 is allowed (Yang et al. 2025, Fig. 7)


def synthetic_features(n: int = 5000, dim: int = 20, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset.from_dict(
        {"label": np.arange(n) % K, "x": (rng.random((n, dim)) * 255).astype(np.float32)},
        features=Features({"label": ClassLabel(num_classes=K), "x": List(Value("float32"))}),
    )


def test_instance_noise_rate_and_expected_transition():
    rate = 0.4
    out, report = corrupt_labels(synthetic_features(), "instance", rate, seed=0, return_report=True)
    assert report.params == {"rate": rate, "feature_column": "x", "norm_std": 0.1}
    assert report.intended_rate == pytest.approx(rate, abs=0.01)  # mean q_i of TruncNormal(0.4, 0.1²)
    assert_rate_close(report.realized_rate, rate, len(out))
    T = np.asarray(report.intended_transition)
    np.testing.assert_allclose(T.sum(axis=1), 1.0)
    assert_rows_close(report)
    again = corrupt_labels(synthetic_features(), "instance", rate, seed=0)
    np.testing.assert_array_equal(labels_of(again), labels_of(out))
    other = corrupt_labels(synthetic_features(), "instance", rate, seed=1)
    assert (labels_of(other) != labels_of(out)).any()


def test_instance_noise_reads_images():
    rng = np.random.default_rng(0)
    n = 1000
    pixels = rng.integers(0, 256, (n, 8, 8), dtype=np.uint8)
    ds = Dataset.from_dict(
        {"image": [PIL.Image.fromarray(p) for p in pixels], "label": np.arange(n) % K},
        features=Features({"image": Image(), "label": ClassLabel(num_classes=K)}),
    )
    out, report = corrupt_labels(ds, "instance", 0.5, seed=0, return_report=True)  # image column auto-detected
    assert report.params["feature_column"] == "image"
    assert_rate_close(report.realized_rate, 0.5, n)
    assert out.features["image"] == Image()
    # the flips are drawn from the pixels: the same pixels as a float column give the same labels
    flat = Dataset.from_dict({"x": pixels.reshape(n, -1).astype(np.float32), "label": np.arange(n) % K},
                             features=Features({"x": List(Value("float32")), "label": ClassLabel(num_classes=K)}))
    np.testing.assert_array_equal(labels_of(out), labels_of(corrupt_labels(flat, "instance", 0.5, seed=0)))


def test_column_noise_reproduces_human_labels():
    ds = balanced(names=CIFAR10_NAMES)
    clean = labels_of(ds)
    rng = np.random.default_rng(0)
    worse = np.where(rng.random(len(ds)) < 0.4, rng.integers(0, K, len(ds)), clean)
    ds = ds.add_column("worse_label", worse.tolist())
    out, report = corrupt_labels(ds, "column", seed=0, noisy_column="worse_label", return_report=True)
    np.testing.assert_array_equal(labels_of(out), worse)
    np.testing.assert_array_equal(labels_of(out, "clean_label"), clean)
    confusion = np.zeros((K, K))
    np.add.at(confusion, (clean, worse), 1)
    np.testing.assert_allclose(report.realized_transition, confusion / confusion.sum(1, keepdims=True))
    assert report.intended_transition == report.realized_transition
    assert report.intended_rate == report.realized_rate == (worse != clean).mean()
    assert report.seed is None and report.params == {"noisy_column": "worse_label"}
    assert out.features["label"] == ds.features["label"]


# ------------------------------------------------------------------------- reproducibility and invariances


def test_seed_reproducibility_and_fingerprint():
    ds = balanced()
    a = corrupt_labels(ds, "symmetric", 0.3, seed=7)
    b = corrupt_labels(ds, "symmetric", 0.3, seed=7)
    c = corrupt_labels(ds, "symmetric", 0.3, seed=8)
    np.testing.assert_array_equal(labels_of(a), labels_of(b))
    assert a._fingerprint == b._fingerprint
    assert (labels_of(a) != labels_of(c)).mean() > 0.2
    assert a._fingerprint != c._fingerprint


def test_independent_of_batch_size_and_num_proc():
    ds = balanced(400)
    reference = labels_of(corrupt_labels(ds, "symmetric", 0.5, seed=3))
    np.testing.assert_array_equal(labels_of(corrupt_labels(ds, "symmetric", 0.5, seed=3, batch_size=7)), reference)
    np.testing.assert_array_equal(labels_of(corrupt_labels(ds, "symmetric", 0.5, seed=3, num_proc=2)), reference)


def test_noise_is_a_function_of_row_index():
    ds = balanced()
    full = corrupt_labels(ds, "pairflip", 0.4, seed=0)
    prefix = corrupt_labels(ds.select(range(1000)), "pairflip", 0.4, seed=0)
    np.testing.assert_array_equal(labels_of(prefix), labels_of(full)[:1000])
    rows = [4999, 3, 1234, 3]
    picked = full.select(rows)
    np.testing.assert_array_equal(labels_of(picked), labels_of(full)[rows])
    np.testing.assert_array_equal(labels_of(picked, "id"), rows)


def test_higher_rate_corrupts_a_superset():
    ds = balanced()
    low = corrupt_labels(ds, "symmetric", 0.2, seed=0)
    high = corrupt_labels(ds, "symmetric", 0.4, seed=0)
    low_flag = labels_of(low, "is_corrupted")
    assert np.all(labels_of(high, "is_corrupted")[low_flag])
    np.testing.assert_array_equal(labels_of(high)[low_flag], labels_of(low)[low_flag])


def test_columns_features_and_input_untouched():
    ds = balanced(names=CIFAR10_NAMES)
    fingerprint, before = ds._fingerprint, ds[:]
    class_map = {"truck": "automobile"}
    out = corrupt_labels(ds, "asymmetric", 0.5, seed=0, class_map=class_map)
    assert out.column_names == ["id", "label", "clean_label", "is_corrupted"]
    assert out.features["label"] == out.features["clean_label"] == ClassLabel(names=CIFAR10_NAMES)
    assert out.features["is_corrupted"] == Value("bool")
    np.testing.assert_array_equal(labels_of(out, "clean_label"), labels_of(ds))
    assert ds._fingerprint == fingerprint and ds[:] == before and ds.column_names == ["id", "label"]
    assert class_map == {"truck": "automobile"}


def test_datasetdict_corrupts_only_requested_splits():
    dd = DatasetDict(train=balanced(), test=balanced(500))
    out, reports = corrupt_labels(dd, "symmetric", 0.2, seed=0, return_report=True)
    assert set(reports) == {"train"}
    assert out["test"] is dd["test"] and "clean_label" not in out["test"].column_names
    assert "clean_label" not in dd["train"].column_names  # the input dict is not modified
    alone = corrupt_labels(dd["train"], "symmetric", 0.2, seed=0)
    np.testing.assert_array_equal(labels_of(out["train"]), labels_of(alone))
    both, reports = corrupt_labels(dd, "symmetric", 0.2, seed=0, splits="train,test".split(","), return_report=True)
    assert set(reports) == {"train", "test"} and "clean_label" in both["test"].column_names
    with pytest.raises(ValueError, match=r"available splits: \['train', 'test'\]"):
        corrupt_labels(dd, "symmetric", 0.2, seed=0, splits=("validation",))


# ----------------------------------------------------------------------------------------------- reports


def test_noise_report_json_round_trip():
    _, report = corrupt_labels(
        balanced(names=CIFAR10_NAMES), "asymmetric", 0.4, seed=0, class_map={9: 1}, return_report=True
    )
    text = json.dumps(report.to_dict(), allow_nan=False)  # strict JSON: no NaN / numpy scalars
    assert NoiseReport.from_json(report.to_json()) == report
    assert NoiseReport.from_dict(json.loads(text)) == report
    assert report.class_names == CIFAR10_NAMES and report.label_column == "label" and report.seed == 0
    assert "asymmetric noise" in report.summary()


def test_noise_report_recomputes_realized_part():
    dd = DatasetDict(train=balanced(), test=balanced(500))
    out, reports = corrupt_labels(dd, "symmetric", 0.3, seed=2, return_report=True)
    again = noise_report(out)
    assert set(again) == {"train"}
    realized = ["num_classes", "num_examples", "num_corrupted", "realized_rate", "realized_transition",
                "per_class_rate", "class_counts", "label_column", "class_names"]
    for name in realized:
        assert getattr(again["train"], name) == getattr(reports["train"], name), name
    assert again["train"].intended_transition is None and again["train"].noise_type is None
    with pytest.raises(ValueError, match="corrupt_labels"):
        noise_report(dd["test"])


def test_corruption_arguments_parse_and_apply():
    parser = HfArgumentParser(CorruptionArguments)
    (args,) = parser.parse_args_into_dataclasses(
        args=["--noise_type", "asymmetric", "--noise_rate", "0.4", "--noise_seed", "3",
              "--noise_class_map", '{"9": 1, "cat": "dog"}', "--noise_splits", "train"]
    )
    assert (args.noise_type, args.noise_rate, args.noise_seed) == ("asymmetric", 0.4, 3)
    dd = DatasetDict(train=balanced(names=CIFAR10_NAMES), test=balanced(100, names=CIFAR10_NAMES))
    out, reports = args.apply(dd)
    direct = corrupt_labels(dd["train"], "asymmetric", 0.4, seed=3, class_map={9: 1, 3: 5})
    np.testing.assert_array_equal(labels_of(out["train"]), labels_of(direct))
    assert reports["train"].params["class_map"] == {"9": 1, "cat": "dog"}

    (none,) = parser.parse_args_into_dataclasses(args=[])
    assert none.apply(dd) == (dd, None)
    (classwise,) = parser.parse_args_into_dataclasses(args=["--noise_type", "classwise", "--noise_kappa", "0.2"])
    _, report = classwise.apply(dd["train"])
    assert report.params == {"kappa": 0.2, "beta": 0.05}
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(args=["--noise_type", "gaussian"])
    with pytest.raises(ValueError, match="--noise_class_map"):
        parser.parse_args_into_dataclasses(args=["--noise_type", "asymmetric"])


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_rate_outside_unit_interval(rate):
    with pytest.raises(ValueError, match=r"rate must be a probability in \[0, 1\]"):
        corrupt_labels(balanced(100), "symmetric", rate, seed=0)


def test_unknown_noise_type_lists_valid_ones():
    with pytest.raises(ValueError, match="use one of .*'symmetric'.*'column'"):
        corrupt_labels(balanced(100), "gaussian", 0.2, seed=0)
    assert NOISE_TYPES == ("symmetric", "uniform", "pairflip", "asymmetric", "classwise", "instance", "column")


def test_missing_label_column_lists_columns():
    with pytest.raises(ValueError, match=r"'labels' not found; columns: \['id', 'label'\]"):
        corrupt_labels(balanced(100), "symmetric", 0.2, seed=0, label_column="labels")


def test_non_integer_labels():
    strings = Dataset.from_dict({"label": ["cat", "dog"]})
    with pytest.raises(TypeError, match="must be integers.*class_encode_column"):
        corrupt_labels(strings, "symmetric", 0.2, seed=0, num_classes=2)
    floats = Dataset.from_dict({"label": [0.0, 1.0]})
    with pytest.raises(TypeError, match="must be integers"):
        corrupt_labels(floats, "symmetric", 0.2, seed=0)


def test_labels_outside_range():
    ds = Dataset.from_dict({"label": [0, 1, 2, -1]})
    with pytest.raises(ValueError, match=r"1 labels of 'label' lie outside \[0, 3\) \(e.g. \[-1\]\).*filter"):
        corrupt_labels(ds, "symmetric", 0.2, seed=0, num_classes=3)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        corrupt_labels(Dataset.from_dict({"label": [0, 1, 2]}), "symmetric", 0.2, seed=0, num_classes=2)


def test_num_classes_inferred_with_warning_or_checked():
    ds = Dataset.from_dict({"label": np.arange(100) % 4})
    with pytest.warns(UserWarning, match="K = max\\(label\\) \\+ 1 = 4.*num_classes="):
        _, report = corrupt_labels(ds, "symmetric", 0.2, seed=0, return_report=True)
    assert report.num_classes == 4 and report.class_names is None
    _, report = corrupt_labels(ds, "symmetric", 0.2, seed=0, num_classes=6, return_report=True)
    assert report.num_classes == 6
    with pytest.raises(ValueError, match="contradicts the ClassLabel"):
        corrupt_labels(balanced(100), "symmetric", 0.2, seed=0, num_classes=5)


def test_asymmetric_map_errors():
    with pytest.raises(ValueError, match=r"Unknown asymmetric class map 'cifar11'.*\['cifar10', 'cifar100', 'mnist'\]"):
        corrupt_labels(balanced(100), "asymmetric", 0.2, seed=0, class_map="cifar11")
    with pytest.raises(ValueError, match="defined for 100 classes but the labels have 10"):
        corrupt_labels(balanced(100), "asymmetric", 0.2, seed=0, class_map="cifar100")
    with pytest.raises(ValueError, match="'unicorn' is not a class"):
        corrupt_labels(balanced(100, names=CIFAR10_NAMES), "asymmetric", 0.2, seed=0, class_map={"unicorn": 1})
    with pytest.raises(ValueError, match=r"asymmetric noise needs \['class_map'\]"):
        corrupt_labels(balanced(100), "asymmetric", 0.2, seed=0)


def test_instance_without_usable_feature_column():
    with pytest.raises(ValueError, match="needs per-example features: pass feature_column="):
        corrupt_labels(balanced(100), "instance", 0.2, seed=0)
    with pytest.raises(ValueError, match="'id' has feature .* not an image or numeric array"):
        corrupt_labels(balanced(100), "instance", 0.2, seed=0, feature_column="id")


def test_classwise_errors():
    with pytest.raises(ValueError, match=r"kappa \+ beta\*K <= 1.*kappa \+ beta\*K = 1.1"):
        corrupt_labels(balanced(100), "classwise", seed=0, kappa=0.6, beta=0.05)
    with pytest.raises(ValueError, match="takes its level from kappa and beta.*leave rate at 0"):
        corrupt_labels(balanced(100), "classwise", 0.3, seed=0, kappa=0.1)
    with pytest.raises(ValueError, match=r"needs \['kappa'\]"):
        corrupt_labels(balanced(100), "classwise", seed=0)


def test_other_bad_inputs():
    ds = balanced(100)
    with pytest.raises(TypeError, match=r"unexpected parameters \['kappa'\]; it takes no extra parameters"):
        corrupt_labels(ds, "symmetric", 0.2, seed=0, kappa=0.1)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        corrupt_labels(ds, "symmetric", 0.2, seed=-1)
    with pytest.raises(ValueError, match="noisy_column 'worse_label' is not a column"):
        corrupt_labels(ds, "column", seed=0, noisy_column="worse_label")
    corrupted = corrupt_labels(ds, "symmetric", 0.2, seed=0)
    with pytest.raises(ValueError, match="already has \\['clean_label', 'is_corrupted'\\].*rename_column"):
        corrupt_labels(corrupted, "symmetric", 0.2, seed=0)
    with pytest.raises(TypeError, match="expects a datasets.Dataset or DatasetDict"):
        corrupt_labels({"label": [0, 1]}, "symmetric", 0.2, seed=0)


@pytest.mark.parametrize("kappa,beta", [(float("nan"), 0.05), (0.1, float("nan"))])
def test_classwise_nan_parameters_refused(kappa, beta):
    # NaN compared False with every bound, so the old check passed and 0 % of the labels were corrupted
    with pytest.raises(ValueError, match="kappa >= 0, beta >= 0"):
        corrupt_labels(balanced(100), "classwise", seed=0, kappa=kappa, beta=beta)


def test_instance_noise_on_nan_features_refused():
    ds = synthetic_features(200)
    x = np.asarray(ds["x"], dtype=np.float64)
    x[3, 0] = np.nan
    ds = ds.remove_columns("x").add_column("x", x.tolist())
    with pytest.raises(ValueError, match="finite features.*'x'"):
        corrupt_labels(ds, "instance", 0.4, seed=0, feature_column="x")


@pytest.mark.parametrize("build", [
    lambda: symmetric_transition(4, 1.5), lambda: asymmetric_transition(4, 2.0, {0: 1}),
    lambda: uniform_transition(4, -0.5),
])
def test_public_transition_builders_refuse_invalid_rates(build):
    with pytest.raises(ValueError, match=r"flip rate in \[0, 1\]"):
        build()


def test_empty_classlabel_dataset_gets_the_columns():
    empty = balanced(0)
    out, report = corrupt_labels(empty, "symmetric", 0.2, seed=0, return_report=True)
    assert out.column_names == ["id", "label", "clean_label", "is_corrupted"]
    assert out.features["clean_label"] == empty.features["label"] and out.features["is_corrupted"] == Value("bool")
    assert len(out) == 0 and report.num_examples == 0
