"""Run by tests/test_lora.py in a subprocess whose HF_ENDPOINT points at the local Hub stand-in: a "pretrained" base
on the Hub, LoRA adapters trained with IVON and pushed, then loaded back and served from the Hub."""

import json
import os
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification

from test_lora import CLASSES, LENGTH, VOCAB, _args, _train_rows, tiny_tokenizer, token_dataset
from varsmooth import VariationalModel, VariationalTrainer, pipeline
from varsmooth.adapters import add_lora_adapters


def main(out: str) -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32,
                        max_position_embeddings=LENGTH + 2, num_labels=CLASSES, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    BertForSequenceClassification(config).push_to_hub("offline-user/tiny-bert")
    tokenizer = tiny_tokenizer(os.path.join(out, "vocab"))
    model = add_lora_adapters(BertForSequenceClassification.from_pretrained("offline-user/tiny-bert"), r=4, alpha=8)
    args = _args(os.path.join(out, "run"), max_steps=3, per_device_train_batch_size=8, eval_mc_samples=4,
                 hub_model_id="offline-user/tiny-lora")
    trainer = VariationalTrainer(model=model, args=args, train_dataset=_train_rows(token_dataset(32)),
                                 eval_dataset=_train_rows(token_dataset(16, seed=1)), processing_class=tokenizer)
    trainer.train()
    trainer.evaluate()
    trainer.push_to_hub()
    texts = ["w5 w9 w12", "w30 w7"]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    expected = torch.as_tensor(trainer.predict([{"input_ids": i, "attention_mask": m, "labels": 0}
                                                for i, m in zip(inputs["input_ids"], inputs["attention_mask"])])
                               .predictions).exp()
    loaded = VariationalModel.from_pretrained("offline-user/tiny-lora")
    with torch.no_grad():
        got = loaded(**inputs).probs
    classify = pipeline("text-classification", model="offline-user/tiny-lora")
    piped = classify(texts, top_k=None)
    names = [config.id2label[k] for k in range(CLASSES)]
    piped_probs = torch.tensor([[next(r["score"] for r in row if r["label"] == name) for name in names]
                                for row in piped])
    json.dump({"max_abs_diff_model": float((got - expected).abs().max()),
               "max_abs_diff_pipeline": float((piped_probs - expected).abs().max()),
               "loaded_is_peft": type(loaded.model).__name__.startswith("Peft")},
              open(os.path.join(out, "results.json"), "w"))


if __name__ == "__main__":
    main(sys.argv[1])
