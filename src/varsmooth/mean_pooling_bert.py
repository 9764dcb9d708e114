"""`MeanPoolingBertForSequenceClassification`: BERT classifying mean-pooled token states, as sentence-transformers
checkpoints (all-MiniLM-L6-v2) are trained.

Registered with the Auto classes when varsmooth is imported, so a saved model reloads through
`AutoModelForSequenceClassification`, `VariationalModel.from_pretrained` and `varsmooth.pipeline`. Without varsmooth,
`save_pretrained` copies this file into the model folder and names its classes in config.json's `auto_map`
(transformers' custom-code convention), so plain transformers loads the model with
`AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)`. The file therefore imports
only torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput

__all__ = ["MeanPoolingBertConfig", "MeanPoolingBertForSequenceClassification"]


class MeanPoolingBertConfig(BertConfig):
    """A BERT config of its own model type, so that a saved mean-pooling model never reloads as a [CLS] one."""

    model_type = "varsmooth-mean-pooling-bert"
    _auto_class = "AutoConfig"  # saved with this file and an `auto_map` entry (see the module docstring)


class MeanPoolingBertForSequenceClassification(BertForSequenceClassification):
    """BERT classifying the mean of its last hidden states over the real tokens (no [CLS] pooler), the pooling
    sentence-transformers checkpoints such as all-MiniLM-L6-v2 are trained with.

    Their [CLS] pooler took no part in that training, and in the first layers the [CLS] state hardly depends on the
    sentence (across SST-2 sentences its std is ~2 % of its size after 2 of MiniLM's layers), so a [CLS] head starts
    on a near-constant input and small fine-tuning steps leave it at chance (50 % on SST-2; a linear probe of the
    mean-pooled states: 80 %). Module names are `BertForSequenceClassification`'s, so its checkpoints load.
    """

    config_class = MeanPoolingBertConfig
    _auto_class = "AutoModelForSequenceClassification"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert.pooler = None  # unused: no dead weights in the posterior

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        outputs = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            position_ids=position_ids, inputs_embeds=inputs_embeds, **kwargs)
        hidden = outputs[0]
        mask = torch.ones(hidden.shape[:2], device=hidden.device) if attention_mask is None else attention_mask
        mask = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:  # VariationalTrainer computes its own loss from the logits; this is for plain use
            loss = torch.nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions)


# registered at import: a saved mean-pooling model reloads through the Auto classes, `VariationalModel.from_pretrained`
# and `varsmooth.pipeline` in any process that imported varsmooth; exist_ok because transformers may also import the
# copy saved beside a model (trust_remote_code=True) in a process that has varsmooth's
AutoConfig.register(MeanPoolingBertConfig.model_type, MeanPoolingBertConfig, exist_ok=True)
AutoModelForSequenceClassification.register(MeanPoolingBertConfig, MeanPoolingBertForSequenceClassification,
                                            exist_ok=True)
