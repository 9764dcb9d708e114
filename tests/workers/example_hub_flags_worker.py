"""Run by tests/test_examples.py in a subprocess whose HF_ENDPOINT points at the local Hub stand-in: a tiny BERT and
its tokenizer on the Hub, then the text example with Hugging Face's model flags (--cache_dir, --model_revision,
--token) fine-tuning it for one step."""

import json
import os
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification

from test_lora import VOCAB, tiny_tokenizer


def main(out: str) -> None:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=80, num_labels=2)
    BertForSequenceClassification(config).push_to_hub("offline-user/tiny-bert")
    tiny_tokenizer(os.path.join(out, "vocab")).push_to_hub("offline-user/tiny-bert")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import train_text_classification as example

    cache = os.path.join(out, "cache")
    sys.argv = ["train_text_classification.py", "--model_name_or_path", "offline-user/tiny-bert", "--cache_dir", cache,
                "--model_revision", "v1", "--token", "hf_flag_token", "--method", "erm", "--max_steps", "1",
                "--max_train_samples", "16", "--max_eval_samples", "8", "--label_noise_samples", "0",
                "--output_dir", os.path.join(out, "run")]
    example.main()
    run = os.path.join(out, "run")
    files = [os.path.join(folder, name) for folder, _, names in os.walk(run) for name in names]
    json.dump({"cached": sorted(os.listdir(cache)), "saved": sorted(os.listdir(run)),
               "token_saved": [f for f in files if b"hf_flag_token" in open(f, "rb").read()]},
              open(os.path.join(out, "results.json"), "w"))


if __name__ == "__main__":
    main(sys.argv[1])
