"""Deep ensembles (Lakshminarayanan et al. 2017, "Simple and Scalable Predictive Uncertainty Estimation using Deep
Ensembles", Eq. 7 with uniform weights): N independently trained models predicting as one.

P̂(y|x) = (1/N) Σ_n P̂_n(y|x), where P̂_n is member n's own prediction: the softmax of a network trained without a
posterior, the Bayesian model average of an IVON member (a mixture of the members' posteriors). The members'
predictions are pooled uncalibrated; a temperature fitted on the pooled prediction (`temperature_scaling`) rescales it
afterwards ("pool-then-calibrate", Rahaman & Thiery 2021).

An ensemble is saved as one folder: its members as `member-0/`, `member-1/`, ... (each a `VariationalModel` folder with
its own manifest), `ensemble_config.json` (the member folders, a fingerprint of each member's weights and the label
set) and the folder's manifest, written last. `VariationalModel.from_pretrained`, `DeepEnsemble.from_pretrained` and
`varsmooth.pipeline` load it; a pipeline reads the tokenizer or image processor saved into the ensemble folder itself.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..adapters import is_peft_model
from ..files import MANIFEST_FILE, FolderSave, check_manifest, read_manifest, recover
from ..temperature_scaling import TemperatureScaling, network_fingerprint
from .modeling import FOLDER_LOADERS, VariationalModel, load_temperature_scaling
from .predictors import EnsemblePredictor, PredictiveModel

__all__ = ["ENSEMBLE_CONFIG_FILE", "DeepEnsemble"]

#: the file of an ensemble folder that lists its member folders, their weights' fingerprints and the label set
ENSEMBLE_CONFIG_FILE = "ensemble_config.json"
MEMBER_PREFIX = "member-"


def _labels(member: VariationalModel) -> tuple[int | None, dict[int, str] | None]:
    config = member.config
    if config is None:
        return None, None
    id2label = getattr(config, "id2label", None)
    return getattr(config, "num_labels", None), ({int(k): str(v) for k, v in id2label.items()} if id2label else None)


class DeepEnsemble(PredictiveModel):
    """The average of the members' predictive distributions.

    `forward(**inputs)` returns a `VariationalClassifierOutput`: `logits` = log P̂ and `probs` = P̂ (the average of the
    members' probabilities), `entropy` = H[P̂], `mutual_information` = H[P̂] − the mean entropy of every single model
    (each member's posterior draws for IVON members), `mean_probs` the average of the members' predictions at their
    weights. Members must classify into the same labels (same number of classes and the same `id2label`).
    """

    def __init__(self, members: Sequence[VariationalModel],
                 temperature_scaling: TemperatureScaling | None = None) -> None:
        super().__init__()
        members = list(members)
        if not members:
            raise ValueError("A DeepEnsemble needs at least one member.")
        for index, member in enumerate(members):
            if not isinstance(member, VariationalModel):
                raise TypeError(f"Member {index} is a {type(member).__name__}: members are varsmooth.VariationalModel "
                                "(load trained folders with DeepEnsemble.from_members, or wrap a network as "
                                "VariationalModel(network, DiagonalGaussianPosterior.point_mass(network))).")
        reference = _labels(members[0])
        for index, member in enumerate(members[1:], start=1):
            labels = _labels(member)
            for name, ours, theirs in (("num_labels", reference[0], labels[0]), ("id2label", reference[1], labels[1])):
                if ours is not None and theirs is not None and ours != theirs:
                    raise ValueError(
                        f"Ensemble member {index} has {name}={theirs} but member 0 has {name}={ours}: the members must "
                        "classify into the same labels in the same order. Ensemble runs trained on the same dataset."
                    )
        self.members = torch.nn.ModuleList(members)
        self.temperature_scaling = temperature_scaling

    @property
    def config(self) -> Any:
        """Member 0's model config (all members share its labels)."""
        return self.members[0].config

    @property
    def predictor(self) -> EnsemblePredictor:
        """The average of the members' predictions (`varsmooth.prediction.predictors.EnsemblePredictor`)."""
        return EnsemblePredictor(self.members)

    @property
    def input_names(self) -> list[str]:
        """The inputs the members' networks take (`forward` takes any keywords and passes them on)."""
        network = self.members[0].model
        network = network.get_base_model() if is_peft_model(network) else network
        return list(inspect.signature(network.forward).parameters)

    # -- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_members(cls, paths: Sequence[str | os.PathLike], **kwargs: Any) -> "DeepEnsemble":
        """An ensemble of trained output folders (or Hub repos), each loaded by `VariationalModel.from_pretrained`
        with `kwargs` (e.g. `num_samples`) and without its own temperature scaling (the pooled prediction is what
        gets calibrated)."""
        if isinstance(paths, (str, os.PathLike)):
            raise TypeError("from_members takes a list of model folders; load a saved ensemble folder with "
                            "from_pretrained.")
        if not paths:
            raise ValueError("from_members got no model folders.")
        members = []
        for path in paths:
            if os.path.isfile(os.path.join(os.fspath(path), ENSEMBLE_CONFIG_FILE)):
                raise ValueError(f"{os.fspath(path)} is itself an ensemble: list its member folders instead.")
            members.append(VariationalModel.from_pretrained(path, temperature_scaling=False, **kwargs))
        return cls(members)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, temperature_scaling: bool = True,
                        **kwargs: Any) -> "DeepEnsemble":
        """Load an ensemble folder written by `save_pretrained`; `kwargs` go to each member's
        `VariationalModel.from_pretrained` (num_samples, seed, temperature, mc_dropout_samples, dtype, ...).

        Refuses a folder whose save did not finish (no manifest), whose members were replaced since (their weights'
        fingerprints differ from those recorded) or whose temperature was fitted for other members.
        """
        folder = os.fspath(path)
        config_path = os.path.join(folder, ENSEMBLE_CONFIG_FILE)
        recover(folder)  # a save killed after it committed has its manifest still staged
        if read_manifest(folder) is None:
            raise ValueError(f"{folder} has {ENSEMBLE_CONFIG_FILE} but no varsmooth manifest: the ensemble's save did "
                             "not finish. Save it again (DeepEnsemble.save_pretrained).")
        check_manifest(folder)
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            names, fingerprints = config["members"], config["member_weights"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{config_path} is not a valid ensemble config ({type(error).__name__}: {error}). Save "
                             "the ensemble again (DeepEnsemble.save_pretrained).") from None
        members = []
        for name, recorded in zip(names, fingerprints):
            member_folder = os.path.join(folder, name)
            if not os.path.isdir(member_folder):
                raise ValueError(f"{member_folder} is missing: the ensemble folder is incomplete. Copy the whole "
                                 "folder, or save the ensemble again (DeepEnsemble.save_pretrained).")
            member = VariationalModel.from_pretrained(member_folder, temperature_scaling=False, **kwargs)
            sha, dtype = network_fingerprint(member.model)
            if dtype != recorded["dtype"]:
                warnings.warn(f"{member_folder} is loaded as {dtype} but was saved as {recorded['dtype']}: it cannot "
                              "be checked that it is the member saved with the ensemble.", UserWarning, stacklevel=2)
            elif sha != recorded["sha256"]:
                raise ValueError(f"{member_folder} holds other weights than the member saved with the ensemble (their "
                                 "fingerprint differs): a model was saved over it. Save the ensemble again "
                                 "(DeepEnsemble.save_pretrained).")
            members.append(member)
        ensemble = cls(members)
        if temperature_scaling:
            ensemble.temperature_scaling = load_temperature_scaling(ensemble, folder)
            if ensemble.temperature_scaling is not None:
                ensemble.temperature_scaling.check_prediction(ensemble.predictor.describe(), folder)
        return ensemble

    # -- saving ------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the members as `member-N/` subfolders, the ensemble config, the temperature (if fitted) and the
        folder's manifest last. Member folders of an earlier ensemble saved here that this one does not have are
        removed. Each member is a save of its own (`varsmooth.files`): a save killed between members leaves members
        whose weights differ from those the ensemble config records, which loading refuses.

        Save the tokenizer or image processor into the same folder (e.g. `tokenizer.save_pretrained(folder)`) for
        `varsmooth.pipeline` to find it.
        """
        folder = os.fspath(save_directory)
        with FolderSave(folder) as save:
            earlier = _member_names(folder)
            names = [f"{MEMBER_PREFIX}{index}" for index in range(len(self.members))]
            # each member is a save of its own into its folder, beside the staged ensemble files
            for name, member in zip(names, self.members):
                member.save_pretrained(os.path.join(folder, name))
            for name in earlier - set(names):
                _remove_unchanged_member(os.path.join(folder, name))
            num_labels, id2label = _labels(self.members[0])
            config = {"format": 1, "members": names, "num_labels": num_labels, "id2label": id2label,
                      "member_weights": [dict(zip(("sha256", "dtype"), network_fingerprint(member.model)))
                                         for member in self.members]}
            with open(os.path.join(save.path, ENSEMBLE_CONFIG_FILE), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
            if self.temperature_scaling is not None:
                self.temperature_scaling.save(save.path, self)
            save.finish(kind="deep_ensemble")


def _remove_unchanged_member(member: str) -> None:
    """Remove an earlier ensemble's member folder only when it holds exactly what its save wrote (its manifest's
    files, unchanged): one with a file edited or added since is yours, and kept."""
    try:
        manifest = read_manifest(member)
        unchanged = manifest is not None and set(os.listdir(member)) <= set(manifest["files"]) | {MANIFEST_FILE}
        if unchanged:
            check_manifest(member)
    except ValueError:  # a file edited since its save
        unchanged = False
    if unchanged:
        shutil.rmtree(member, ignore_errors=True)
    else:
        warnings.warn(f"Kept {member}, a member of the ensemble saved there before: it holds files its save did not "
                      "write, or edited since. Remove it yourself if it is not needed.", UserWarning, stacklevel=3)


def _member_names(folder: str) -> set[str]:
    """The member folders listed by an ensemble config already in `folder` (none if it has none or it is unreadable)."""
    try:
        with open(os.path.join(folder, ENSEMBLE_CONFIG_FILE), encoding="utf-8") as f:
            names = json.load(f)["members"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {name for name in names if isinstance(name, str) and name.startswith(MEMBER_PREFIX) and os.sep not in name}


FOLDER_LOADERS[ENSEMBLE_CONFIG_FILE] = DeepEnsemble.from_pretrained
