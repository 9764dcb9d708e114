"""The tables of benchmarks/README.md (and the front page's headline table) are what the benchmark scripts compute from
the committed results: a hand edit of a generated block, or a report that no longer reproduces it, fails here.
Reports only read cached JSON (no training); the MNIST studies need the MNIST file for its size and skip without it."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402

README = REPO / "benchmarks" / "README.md"


def block(name: str, readme: Path = README) -> str:
    """The committed text between the markers of `name`."""
    text = readme.read_text()
    begin, end = f"<!-- generated:{name} -->\n", f"\n<!-- /generated:{name} -->"
    assert begin in text and end in text, f"{readme.name} has no generated block {name!r}"
    return text.split(begin, 1)[1].split(end, 1)[0]


def needs_mnist() -> None:
    try:
        common.load_data("mnist")
    except common.DataUnavailable as error:
        pytest.skip(str(error))


def test_write_readme_section_replaces_only_its_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- generated:a -->\nold a\n<!-- /generated:a -->\nmiddle\n<!-- generated:b -->\nold b\n"
                      "<!-- /generated:b -->\nend\n")
    common.write_readme_section("a", "new a\n", readme=readme)
    assert readme.read_text() == ("intro\n<!-- generated:a -->\nnew a\n<!-- /generated:a -->\nmiddle\n"
                                  "<!-- generated:b -->\nold b\n<!-- /generated:b -->\nend\n")
    common.write_readme_section("c", "c", readme=readme)  # no markers yet: appended, then replaced in place
    common.write_readme_section("c", "c2", readme=readme)
    assert readme.read_text().endswith("<!-- generated:c -->\nc2\n<!-- /generated:c -->\n")
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]  # no temporary file left behind


def regenerate(report, tmp_path: Path, monkeypatch, *args) -> Path:
    """Run `report(*args)` with benchmarks/README.md copied to tmp_path; return the copy it wrote into."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(README, tmp_path / "benchmarks" / "README.md")
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path)
    report(*args)
    return tmp_path / "benchmarks" / "README.md"


@pytest.mark.parametrize("script, section, source", [
    ("trainer_overhead", "trainer_overhead", "trainer_overhead/trainer_overhead.json"),
    ("label_noise_cost", "label_noise_cost", "label_noise_cost.json"),
    ("mislabel_detection", "mislabel_detection", "mislabel_detection.json"),
])
def test_json_reports_reproduce_their_tables(script, section, source, tmp_path, monkeypatch):
    module = __import__(script)
    copy = tmp_path / "results" / source
    copy.parent.mkdir(parents=True)
    shutil.copy(common.RESULTS_DIR / source, copy)
    arg = {"trainer_overhead": copy.parent, "label_noise_cost": str(copy), "mislabel_detection": str(copy.parent)}[script]
    written = regenerate(module.report, tmp_path, monkeypatch, arg)
    assert block(section, written) == block(section)
    assert written.read_text() == README.read_text()  # and nothing else of the file moved


def test_training_length_tables_are_the_reports():
    import training_length_report as report

    for epochs in (20, 60):
        runs = report.collect(epochs)
        assert runs, f"no cached {epochs}-epoch runs"
        assert report.readme_table(runs, epochs) == block(f"training_length_e{epochs}")


def test_robustness_tables_are_the_reports():
    needs_mnist()
    import robustness

    def plan(**flags):
        defaults = dict(quick=False, noises=None, methods=None, seeds=None, epochs=None, fig6=False, fig10=False,
                        ivon_check=False)
        return robustness.plan(argparse.Namespace(**{**defaults, **flags}))

    dataset, epochs, noises, seeds, specs = plan()
    table = robustness.collect(dataset, epochs, noises, seeds, specs)
    assert robustness.sweep_table(table, noises, robustness.SWEEP_COLUMNS) == block("robustness")
    assert robustness.sweep_table(table, noises, robustness.HEADLINE_COLUMNS) == block("headline", REPO / "README.md")
    dataset, epochs, noises, seeds, _ = plan(fig6=True, noises="sym20,sym40,pair20")
    assert robustness.fig6_table(dataset, epochs, noises, seeds) == block("fig6")
    dataset, epochs, noises, seeds, _ = plan(fig10=True, noises="sym40,pair20")
    assert robustness.fig10_table(dataset, epochs, noises, seeds) == block("fig10")


def test_device_agreement_table_is_the_report(tmp_path, monkeypatch):
    import device_agreement

    gpu = device_agreement.gpu_runs(6)
    cpu = [common.cached(device_agreement.SCRIPT, **{k: r["config"][k] for k in device_agreement._JOB_KEYS}) for r in gpu]
    assert len(gpu) == 6 and all(c is not None for c in cpu)
    monkeypatch.setattr(device_agreement, "OUT_DIR", tmp_path / "device_agreement")
    written = regenerate(device_agreement.report, tmp_path, monkeypatch, gpu, cpu)
    assert block("device_agreement", written) == block("device_agreement")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lora_table_is_the_report(tmp_path, monkeypatch, device):
    import lora

    folder = "lora" if device == "cpu" else f"lora_{device}"
    monkeypatch.setattr(lora, "_results_dir", lambda device: tmp_path / folder)
    shutil.copytree(common.RESULTS_DIR / folder / "runs", tmp_path / folder / "runs")
    if (common.RESULTS_DIR / folder / "scale.json").is_file():  # names the GPU in the GPU table
        shutil.copy(common.RESULTS_DIR / folder / "scale.json", tmp_path / folder)
    written = regenerate(lambda: lora.report(device), tmp_path, monkeypatch)
    assert block(folder, written) == block(folder)
    assert json.loads((tmp_path / folder / "summary.json").read_text())  # the summary is written beside it
